"""The spine every benchmark stands on, written once: `procs` starts and reaps engines and
routers, `cpu` opens CPU windows, `results` stamps a run (date, commit, machine, load) and writes
its tables and JSON, `run` alternates a scenario's targets against the same-run baseline and
judges its verdicts."""
