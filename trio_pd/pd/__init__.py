"""One PD request: what the router reads of a client's body, the fields it injects, the attempt
(prefill and decode legs in one nursery), the stream relay, the outcome of each leg, the retry
loop, and the aborts handed to a long-lived service. Knows nothing of ASGI routes or of where
workers come from."""
