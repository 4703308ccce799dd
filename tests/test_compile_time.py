"""The bench's cold and warm compile times: ``bench.step --compile-cache cold-warm`` runs the
bench twice on one new cache directory and reports both; ``bench.compile_time`` prints the
compile-time-versus-depth table. Checked here without compiling anything (the ranks' spawn
and the measuring subprocess are replaced)."""

from __future__ import annotations

import os

import bench.compile_time as compile_time
import bench.step as step
from bench.report import to_markdown


def _record(name: str, compile_s: float) -> dict:
    return {"system": name, "compile_s": compile_s}


def test_cold_warm_runs_twice_on_one_new_cache_directory(monkeypatch):
    seen: list[str] = []

    def spawn(args):
        seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return [_record("graphshard-compiled", 30.0 if len(seen) == 1 else 4.0)]

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    monkeypatch.setattr(step, "_spawn", spawn)
    records = step._spawn_cold_warm(None)
    assert len(seen) == 2 and seen[0] == seen[1] != "/somewhere/else"
    assert not os.path.exists(seen[0])  # removed afterwards
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
    assert records == [{"system": "graphshard-compiled", "compile_s": 30.0,
                        "compile_s_warm": 4.0}]


def test_the_report_shows_cold_and_warm(monkeypatch):
    import bench.report

    monkeypatch.setattr(bench.report, "header", lambda report: "")
    fields = {"step_s_median": None, "step_s_p10": None, "step_s_p90": None,
              "peak_mem_bytes": None, "collectives_per_step": None, "bytes_per_step": None,
              "final_loss": None, "predicted_step_s": None, "notes": ""}
    report = {"reference": {"zero3_bytes_per_rank": 1.0},
              "systems": [{**fields, "system": "graphshard-compiled", "compile_s": 30.0,
                           "compile_s_warm": 4.0}]}
    table = to_markdown(report)
    assert "compile s cold / warm" in table and "| 30.00 / 4.00 |" in table
    report["systems"][0].pop("compile_s_warm")
    assert "compile s cold" not in to_markdown(report)


def test_the_depth_table_measures_each_system_cold_then_warm(monkeypatch, capsys):
    calls: list[tuple[str, int, str]] = []

    def measure(system, layers, cache_dir, **kwargs):
        calls.append((system, layers, cache_dir))
        warm = sum(c[:2] == (system, layers) for c in calls) > 1
        return {"system": system, "layers": layers, "first_step_s": 2.0 if warm else 20.0,
                "process_s": 0.0, "fxgraph_cache_hit" if warm else "fxgraph_cache_miss": 2}

    monkeypatch.setattr(compile_time, "measure", measure)
    rows = compile_time.main(["--layers", "2", "8", "--systems", "a", "b",
                              "--caches", "cold", "warm"])
    assert [(c[0], c[1]) for c in calls] == [("a", 2), ("a", 2), ("b", 2), ("b", 2),
                                             ("a", 8), ("a", 8), ("b", 8), ("b", 8)]
    assert calls[0][2] == calls[1][2] != calls[2][2]  # warm reuses its cold run's directory
    assert len(rows) == 8
    out = capsys.readouterr().out
    assert "| a | 8 | 20.0 (fx 0h/2m, aot 0h/0m) | 2.0 (fx 2h/0m, aot 0h/0m) |" in out


def test_the_phase_table_shows_where_each_measurements_seconds_went(monkeypatch, capsys):
    def measure(system, layers, cache_dir, **kwargs):
        phases = {"Scheduler.codegen": 10.0 + layers, "bytecode_tracing": 0.5 * layers,
                  "tiny": 0.01}
        return {"system": system, "layers": layers, "first_step_s": 20.0, "process_s": 0.0,
                "phases_s": phases, "cxx_compiles": 30 + layers}

    monkeypatch.setattr(compile_time, "measure", measure)
    compile_time.main(["--layers", "2", "16", "--systems", "a", "--phases", "2"])
    out = capsys.readouterr().out
    assert "| phase (s) | a 2L cold | a 16L cold |" in out
    assert "| C++ compiles | 32 | 46 |" in out
    # the two phases with the most seconds in any column, largest first; "tiny" left out
    assert out.index("| Scheduler.codegen | 12.00 | 26.00 |") < \
        out.index("| bytecode_tracing | 1.00 | 8.00 |")
    assert "| tiny |" not in out
    compile_time.main(["--layers", "2", "--systems", "a"])
    assert "phase (s)" not in capsys.readouterr().out  # only when asked


def test_the_gloo_table_sums_each_ranks_cpu_and_compares_with_one_rank(monkeypatch, capsys):
    calls: list[tuple[str, bool, int]] = []

    def measure_gloo(system, layers, cache_dir, *, ranks, per_rank_cache, **kwargs):
        calls.append((system, per_rank_cache, ranks))
        cpu = [40.0, 40.0] if system == "alone" else [30.0, 20.0]
        return {"system": system, "layers": layers, "first_step_s": 41.0,
                "cache": "per rank" if per_rank_cache else "shared", "cpu_s_sum": sum(cpu),
                "ranks": [{"first_step_cpu_s": c} for c in cpu]}

    monkeypatch.setattr(compile_time, "measure_gloo", measure_gloo)
    rows = compile_time.main(["--gloo-ranks", "2", "--layers", "16", "--gloo-cache",
                              "per-rank", "shared", "--systems", "shared", "alone"])
    assert calls == [("shared", True, 2), ("shared", False, 2), ("alone", True, 2),
                     ("alone", False, 2)]
    assert len(rows) == 4
    out = capsys.readouterr().out
    # one rank alone: 40 s, whichever row comes first; two sharing: 30 + 20 = 50 s, 1.25x
    assert "| shared | shared | cold | 16 | 41.0 | 30.0 / 20.0 | 50.0 | 1.25 |" in out
    assert "| alone | per rank | cold | 16 | 41.0 | 40.0 / 40.0 | 80.0 | 2.00 |" in out


def test_a_warm_gloo_launch_reuses_its_cold_launchs_directory(monkeypatch):
    dirs: list[str] = []

    def measure_gloo(system, layers, cache_dir, *, ranks, per_rank_cache, **kwargs):
        dirs.append(cache_dir)
        return {"system": system, "layers": layers, "first_step_s": 1.0, "cache": "shared",
                "cpu_s_sum": 2.0, "ranks": [{"first_step_cpu_s": 1.0}] * ranks}

    monkeypatch.setattr(compile_time, "measure_gloo", measure_gloo)
    rows = compile_time.main(["--gloo-ranks", "2", "--layers", "2", "--systems", "a", "b",
                              "--caches", "cold", "warm"])
    assert [r["start"] for r in rows] == ["cold", "warm", "cold", "warm"]
    assert dirs[0] == dirs[1] != dirs[2] == dirs[3]  # a restart of each system's job
