"""Worker membership: where the router learns which workers exist.

One small interface, several sources (static flags, the admin API, the shared file of
`--workers N`, Kubernetes, etcd). Every source hands the registry its *whole* desired set,
level-triggered, and a source only ever removes the workers it added, so sources never fight.
`setup.py` decides which store and sources a router runs; docs/scaling-out.md tells
operators.
"""
