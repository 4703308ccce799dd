"""Work that every rank's first compile repeats, done once in the ranks' fork server
(``dist_utils.PRELOAD`` imports this module there) and inherited by every rank it forks.

Inductor's choice of the CPU's vector instruction set (``pick_vec_isa``, cached for the
process) compiles and loads a probe for each candidate in subprocesses: about 2 s in every
fresh process, on each of the suite's rank launches. It depends on the machine only, so a
forked rank may inherit it. Nothing else is warmed: Inductor's pattern passes are set up for
the first graph's device, which a rank must choose itself.
"""

from torch._inductor.cpu_vec_isa import pick_vec_isa

pick_vec_isa()  # fills valid_vec_isa_list's cache, which the forked ranks inherit
