"""Serving layer: processes, listening sockets, hypercorn's trio worker, the supervisor of
`--workers N` and the metrics listener. It runs the edge's ASGI app; nothing below imports it."""
