"""Tooling around the serving core, which never imports it: the ``engram`` command (:mod:`.cli`,
:mod:`.shm_cli`), its demos, the streaming-engine simulation, profiling and cache-policy replays,
real text on the machine, checkpoint reports and synthetic checkpoints for tests (:mod:`.testing`)."""
