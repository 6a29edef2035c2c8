"""Tools that run before or beside a training job: ``tandem plan`` (will it fit,
and how to shard it) and ``tandem check`` (does the distributed run train the
same model as one process). Each is a pure part (what to compute) and a command
line (``tandem <tool> --help``)."""
