"""The machine profile: everything the suite measures about the machine it runs on, in one place.

    load.py       how busy the machine was over an interval (the busy flag of profiles and answers)
    threads.py    OpenMP's wait policy, chosen when the suite is imported
    probes.py     memory read bandwidth and the weight bytes of a forward (the roofline)
    plan.py       timing the linear kernels per weight shape and row count (the linear plan)
    curves.py     timing the target's forward by tokens per forward (the latency curve)
    dtype.py      `dtype=auto`: the flags, and on a CPU with native bf16, bf16 timed against fp32
    profile.py    `MachineProfile`: the above built once per process, stored per machine, handed in

What the machine is (its CPU flags, ISA class, the key of its profile) is `engine/hardware.py`, read without
timing anything. The harness builds one `MachineProfile` and passes it to the runners (`ModelRunner(...,
profile=)`) and to the methods' builders (`BuildContext.profile`); nothing else times the machine. This
package's `__init__` imports nothing: `threads` must run before torch loads (`methods/__init__.py`)."""
