"""CPU threads of one engine process: each thread's own intra-op count (intra_op.py), the engine
thread's and the encoder's shares chosen by measurement (thread_choice.py), what they ended up at
and how (thread_report.py), and the CPUs other processes took lately (host_cpu.py)."""
