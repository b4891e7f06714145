"""A process's file descriptors: the soft limit raised to the hard one at start, and how many
client connections of the data port may hold one (`--max-client-connections`).

Every client connection holds a descriptor from its accept until it closes (30 s without a
byte, 90 s idle after a request), and nothing bounded how many: at a limit of 2,048, 2,098 idle
connections made every `accept` fail with EMFILE, the data port's and the side listeners'
alike, so `/generate`, the admin listener and the probe listener all timed out for 40+ s (issue
26, N6), where the probe listener exists so that a saturated data plane does not get a healthy
router killed. The cap keeps a reserve: `RESERVED_FDS` for the probe, admin and metrics
listeners' connections, log files, the control plane's connections to the engines and trio's
own, and of the rest a third for client connections, since each may hold two more (its
request's prefill and decode legs).
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)
RESERVED_FDS = 256
FDS_PER_CLIENT = 3  # its own, and its request's two legs
UNLIMITED_TARGET = 1 << 20  # a hard limit of "unlimited": ask for this much (Linux's nr_open)


def raise_soft_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one, as far as the kernel allows; the soft
    limit in force afterwards. Many systems start processes at 1,024 under a far higher hard
    limit, which would make the derived cap needlessly small."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.info("file descriptor limit stays %d (raising it to %d: %s)", soft, target, exc)
            return soft
        return target
    return soft


def client_connection_cap(configured: int) -> int:
    """`--max-client-connections`, or (0) the share of the current soft limit derived above."""
    if configured > 0:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = UNLIMITED_TARGET
    return max(1, (soft - RESERVED_FDS) // FDS_PER_CLIENT)
