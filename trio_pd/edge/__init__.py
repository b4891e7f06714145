"""The edge: the router's ASGI app. The route table, the generation request path, probes, the
lifespan and its long-lived services, and the request-level concerns in front of dispatch
(auth, admission, drain, CORS, request ids, body intake, tracing)."""
