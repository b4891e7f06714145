"""`trio-pd serve`'s blocking entry point: one process, or the supervisor of `--workers N`."""

from __future__ import annotations

import logging
from functools import partial

import trio

from trio_pd.config import RouterConfig
from trio_pd.observe.logs import LogDirError
from trio_pd.observe.logs import configure as configure_logging
from trio_pd.serve.admin_listener import AdminListenError, bind_admin
from trio_pd.serve.listeners import close_sockets
from trio_pd.serve.metrics_listener import MetricsListenError, bind_metrics
from trio_pd.serve.probe_listener import ProbeListenError, bind_probes
from trio_pd.serve.process import _serve_main

log = logging.getLogger(__name__)


def run(config: RouterConfig) -> int:
    """Blocking entry point of `trio-pd serve`; the exit status. A start-up failure of the
    environment (a log directory, a port) exits with its reason, not a traceback."""
    try:
        configure_logging(config.log_level, json_lines=config.log_json, log_dir=config.log_dir)
        for warning in config.startup_warnings:
            log.warning("%s", warning)
        if config.workers <= 1:
            metrics_sockets = admin_sockets = probe_sockets = None
            if config.prometheus_port is not None:
                metrics_sockets = bind_metrics(config.prometheus_host, config.prometheus_port)
            probe_port = config.edges.health_check_port
            try:
                if config.admin_port is not None:
                    admin_sockets = bind_admin(config.admin_host, config.admin_port)[0]
                if probe_port is not None:
                    probe_sockets = bind_probes(config.host, probe_port)[0]
            except (AdminListenError, ProbeListenError):
                for made in (metrics_sockets, admin_sockets):
                    if made is not None:
                        close_sockets(made)
                raise
            main = partial(_serve_main, config, metrics_sockets=metrics_sockets)
            return trio.run(partial(main, admin_sockets=admin_sockets, probe_sockets=probe_sockets))
        from trio_pd.serve.supervisor import Supervisor

        return Supervisor(config).run()
    except (LogDirError, MetricsListenError, AdminListenError, ProbeListenError) as exc:
        raise SystemExit(f"trio-pd serve: error: {exc}") from None
