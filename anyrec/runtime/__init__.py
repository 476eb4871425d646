"""The process: its place in the job and how it ends.

`distributed` (rendezvous, the world, the `Runtime` a process sets up once: backend, process group, core
binding), `agreement` (decisions the ranks take together), `shutdown` (stop signals, the heartbeat,
bounded waits), `errors` (what the entry point turns into one line) and `clock` (when the job began).
Everything that runs in a job stands on this package; it stands on the backends alone.
"""
