"""`trio-pd serve`'s blocking entry point: one process, or the supervisor of `--workers N`."""

from __future__ import annotations

import logging
from functools import partial

import trio

from trio_pd.config import RouterConfig
from trio_pd.observe.logs import LogDirError
from trio_pd.observe.logs import configure as configure_logging
from trio_pd.serve.doors import ListenError, bind_doors, data_door, side_doors
from trio_pd.serve.process import _serve_main

log = logging.getLogger(__name__)


def run(config: RouterConfig) -> int:
    """Blocking entry point of `trio-pd serve`; the exit status. A start-up failure of the
    environment (a log directory, a port any door cannot have) exits with its reason in one
    line, not a traceback: every door is bound before anything runs."""
    try:
        configure_logging(config.log_level, json_lines=config.log_json, log_dir=config.log_dir)
        for warning in config.startup_warnings:
            log.warning("%s", warning)
        if config.workers <= 1:
            listening = bind_doors((*side_doors(config), data_door(config)), config)
            return trio.run(partial(_serve_main, config, listening))
        from trio_pd.serve.supervisor import Supervisor

        return Supervisor(config).run()
    except (LogDirError, ListenError) as exc:
        raise SystemExit(f"trio-pd serve: error: {exc}") from None
