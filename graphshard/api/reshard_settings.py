"""``shard(reshard_after_forward={module: setting, ...})``: a setting per module.

FSDP2 takes ``reshard_after_forward`` per ``fully_shard`` call, so a model sharded block by
block can keep some blocks gathered from forward to backward and free the others
(``fully_shard(block, reshard_after_forward=False)``). graphshard shards once, on the root;
the same choice is a mapping from submodules (or their names, ``""`` for the root) to a
setting, each a value the option takes for the whole model: ``True``, ``False``, ``"auto"``
or an int ``k``. A parameter takes the setting of the innermost key that holds it, as a
nested ``fully_shard`` call takes its module's parameters out of the outer one; the
parameters no key holds take ``True``, the default.

A bucket is gathered in one collective and kept or freed as a whole, so a bucket whose
parameters ask for different settings becomes one bucket per setting (as a bucket of two
dtypes becomes two), named after the group with the setting appended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from graphshard.api.reshard_groups import resolve_reshard
from graphshard.errors import GraphshardTypeError, GraphshardValueError

__all__ = ["ReshardSettings", "check_setting", "resolve_settings", "settings_of_params"]

DEFAULT = True  # what a parameter no key holds takes: ZeRO-3, as for the whole model


def check_setting(value: object, where: str = "reshard_after_forward") -> None:
    """``value`` is one setting: True, False, ``"auto"`` or an int (its range is checked
    against the ranks later, :func:`graphshard.api.reshard_groups.resolve_reshard`)."""
    if not isinstance(value, (bool, int)) and value != "auto":
        raise GraphshardTypeError(
            f"graphshard.shard() option {where} must be True (free the gathered parameters "
            f"after forward, ZeRO-3) or False (keep them for backward, ZeRO-2), an int k "
            f"(keep 1/k of each, gathered again over groups of k ranks), 'auto' (the "
            f"compiler chooses per bucket within backend(memory_budget=...)), or a dict "
            f"from submodules (or their names) to one of those; got {value!r} "
            f"({type(value).__name__})"
        )


@dataclass
class ReshardSettings:
    """Each parameter's setting, resolved against the shard group (``1`` read as False, the
    rank count as True), and for an int ``k`` this rank's group of ``k`` ranks."""

    setting_of: dict[int, Any]  # id(parameter) -> True, False, "auto" or k
    group_of: dict[int, dist.ProcessGroup | None]  # id(parameter) -> its group of k, or None
    model_setting: Any  # the option as the model records it: one setting, or name -> setting

    def of_param(self, param: nn.Parameter) -> tuple[Any, dist.ProcessGroup | None]:
        """``param``'s setting and group of ``k`` (by the parameter passed to ``shard``)."""
        return self.setting_of[id(param)], self.group_of[id(param)]

    def kind(self, param: nn.Parameter) -> str:
        """What parameters of one bucket share: their setting (``True`` and ``1`` told
        apart: 1 keeps everything), and with it their group of ``k``."""
        return _key(self.setting_of[id(param)])

    def label(self, kind: str) -> str:
        """The suffix of a bucket split off for setting ``kind`` (:meth:`kind`)."""
        setting = next(v for v in self.setting_of.values() if _key(v) == kind)
        return f"reshard_after_forward={setting!r}"

    def of_buckets(self, bucket_of: dict[int, int]) -> list[Any]:
        """The setting of each bucket, by index (after the split by :meth:`kind`: one
        each)."""
        out: dict[int, Any] = {}
        for pid, bucket in bucket_of.items():
            out.setdefault(bucket, self.setting_of[pid])
        return [out.get(b, DEFAULT) for b in range(max(out, default=-1) + 1)]


def resolve_settings(module: nn.Module, option: Any, group: dist.ProcessGroup
                     ) -> ReshardSettings:
    """``shard``'s ``reshard_after_forward`` for every parameter of ``module``. Every rank
    must call it: the groups of each distinct int are made over the default group, in one
    order on every rank."""
    raw = settings_of_params(module, option)
    per_module = isinstance(option, Mapping)
    named = _prefixes(module, option) if per_module else {}
    asked = [value for value, _ in named.values()] if per_module else [option]
    distinct = sorted({_key(v): v for v in [*raw.values(), *asked]}.items())
    resolved = {key: resolve_reshard(value, group) for key, value in distinct}
    # as the model records it: rank-independent, for the ranks' plan check (a mapping by
    # its modules' names)
    model_setting = (resolved[_key(option)][0] if not per_module else
                     {name: resolved[_key(value)][0] for name, (value, _) in sorted(named.items())})
    return ReshardSettings(
        setting_of={pid: resolved[_key(v)][0] for pid, v in raw.items()},
        group_of={pid: resolved[_key(v)][1] for pid, v in raw.items()},
        model_setting=model_setting)


def settings_of_params(module: nn.Module, option: Any) -> dict[int, Any]:
    """id(parameter) -> the setting it takes: ``option`` itself for every parameter, or for
    a mapping the setting of the innermost key that holds the parameter (by its first name,
    the one ``named_parameters`` gives a tied parameter), :data:`DEFAULT` where none does."""
    params = dict(module.named_parameters())
    if not isinstance(option, Mapping):
        check_setting(option)
        return {id(p): option for p in params.values()}
    by_prefix = _prefixes(module, option)
    settings = {}
    for fqn, p in params.items():
        parts = fqn.split(".")
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)
                      if ".".join(parts[:i]) in by_prefix), None)
        settings[id(p)] = DEFAULT if owner is None else by_prefix[owner][0]
    return settings


def _prefixes(module: nn.Module, option: Mapping) -> dict[str, tuple[Any, str]]:
    """Every name of every key's module -> (its setting, the key as the user wrote it)."""
    names_of: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        names_of.setdefault(id(sub), []).append(name)
    by_prefix: dict[str, tuple[Any, str]] = {}
    for key, value in option.items():
        label = _label(key)
        check_setting(value, f"reshard_after_forward[{label}]")
        if isinstance(key, str):
            try:
                sub = module.get_submodule(key)
            except AttributeError:
                raise GraphshardValueError(
                    f"graphshard.shard() option reshard_after_forward names {key!r}, which is "
                    f"not a submodule of the {type(module).__name__} being sharded: use a "
                    f"name from model.named_modules() ('' for the root), or the module "
                    f"itself.") from None
        elif isinstance(key, nn.Module):
            sub = key
        else:
            raise GraphshardTypeError(
                f"graphshard.shard() option reshard_after_forward, as a dict, maps submodules "
                f"(or their names) to settings; got a key {key!r} ({type(key).__name__})")
        if id(sub) not in names_of:
            raise GraphshardValueError(
                f"graphshard.shard() option reshard_after_forward has a key {label}, which is "
                f"not a submodule of the {type(module).__name__} being sharded.")
        if next(sub.parameters(), None) is None:
            raise GraphshardValueError(
                f"graphshard.shard() option reshard_after_forward has a key {label}, which "
                f"holds no parameters: name modules with parameters.")
        for name in names_of[id(sub)]:
            earlier = by_prefix.get(name)
            if earlier is not None and earlier[0] != value:
                raise GraphshardValueError(
                    f"graphshard.shard() option reshard_after_forward gives module {name!r} "
                    f"two settings: {earlier[0]!r} (key {earlier[1]}) and {value!r} (key "
                    f"{label}); give each module one.")
            by_prefix[name] = (value, label)
    return by_prefix


def _label(key: object) -> str:
    return repr(key) if isinstance(key, str) else f"<{type(key).__name__}>"


def _key(setting: Any) -> str:
    """``True`` and ``1`` are equal in Python but not as settings (1 keeps everything)."""
    return f"{type(setting).__name__}:{setting!r}"
