"""Talking to workers: the hot path's HTTP/1.1 client (httptools over trio sockets) and its
pool, the headers each leg carries, the control plane's httpx2 client, TLS to workers, and the
rules for worker URLs. Pure transport: nothing here knows what a PD request is."""
