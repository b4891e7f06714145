"""The flag table of `trio-pd serve`: every flag declared once, in one row (`flag.py`).

`SERVE_FLAGS` is the router's own flags in `--help` order (the fleet's, routing's, overload's,
serving's, membership's, vLLM's); SGLang's router flags a PD router accepts but does not act on
are `config/compat.py`'s `FOREIGN` rows. The parser (`cli/parser.py`), the RouterConfig
(`config/build.py`) and the docs' flag tables (`tests/flag_surface.py`) are all made from these.
"""

from trio_pd.config.flags.edges import EDGES
from trio_pd.config.flags.flag import SWITCH, Flag, by_name
from trio_pd.config.flags.fleet import DECODE_WORKER, FLEET, PREFILL_WORKER
from trio_pd.config.flags.membership import MEMBERSHIP
from trio_pd.config.flags.overload import OVERLOAD
from trio_pd.config.flags.routing import ROUTING
from trio_pd.config.flags.serving import SERVING
from trio_pd.config.flags.vllm import VLLM

SERVE_FLAGS: tuple[Flag, ...] = (
    *FLEET, *ROUTING, *OVERLOAD, *SERVING, *EDGES, *MEMBERSHIP, *VLLM,
)  # fmt: skip
BY_NAME = by_name(SERVE_FLAGS)
# The flags whose meaning in trio_pd is wider or stricter than in SGLang's router, and why: the
# docs' flag table shows these notes, and a default that differs from SGLang's must have one.
DIFFERS = {row.name: row.differs for row in SERVE_FLAGS if row.differs}

__all__ = [
    "BY_NAME", "DECODE_WORKER", "DIFFERS", "PREFILL_WORKER", "SERVE_FLAGS", "SWITCH", "Flag",
    "by_name",
]  # fmt: skip
