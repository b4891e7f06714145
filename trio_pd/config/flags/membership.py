"""The table's rows for membership: the shared file, Kubernetes pod discovery and etcd (one row a
flag: see `flag.py`). A sub-config exists only when its `enables` row is given a true value."""

from __future__ import annotations

from trio_pd.config.flags.flag import SWITCH, Flag
from trio_pd.config.membership import (
    DEFAULT_BOOTSTRAP_PORT_ANNOTATION,
    DEFAULT_WORKER_PORTS_ANNOTATION,
    parse_selector,
)

KUBE = "service discovery (Kubernetes)"
ETCD = "etcd membership (shared by router replicas)"

FILE = "service discovery (file)"

MEMBERSHIP: tuple[Flag, ...] = (
    Flag(
        "--membership-file",
        "read (and write) worker membership in this JSON file (e.g. a ConfigMap)",
        "membership_file",
    ),
    # SMG 1.13's spelling of discovery: `--discovery-provider kubernetes` is
    # `--service-discovery`; `file` reads its manifest (`membership/manifest.py`).
    Flag(
        "--discovery-provider",
        "worker discovery provider: kubernetes (as --service-discovery) or file (the workers "
        "listed in the --discovery-file manifest, SMG's shape, read-only)",
        "discovery_provider",
        choices=("kubernetes", "file"),
        group=FILE,
    ),
    Flag(
        "--discovery-file",
        "JSON manifest listing the workers, for --discovery-provider file "
        '({"version": 1, "workers": [{"id", "url", "worker_type", "bootstrap_port", ...}]}); '
        "it may be created after startup",
        "discovery_file",
        group=FILE,
    ),
    Flag(
        "--discovery-check-interval-secs",
        "seconds between full rereads of the --discovery-file manifest, which is also reread "
        "as soon as it changes (default: 30)",
        "discovery_check_interval_secs",
        type=float,  # no default, as SMG's: given without the file provider, it is refused
        group=FILE,
    ),
    Flag(
        "--service-discovery",
        "discover workers from Kubernetes pods",
        action=SWITCH,
        enables="kubernetes",
        group=KUBE,
    ),
    *(
        Flag(
            f"--{role}selector",
            what,
            f"kubernetes.{role.replace('-', '_')}selector",
            default=[],
            nargs="*",
            metavar="KEY=VALUE",
            convert=parse_selector,
            group=KUBE,
        )
        for role, what in (
            ("", "labels every worker pod carries (narrows both role selectors)"),
            ("prefill-", "labels of prefill worker pods"),
            ("decode-", "labels of decode worker pods"),
        )
    ),
    Flag(
        "--service-discovery-port",
        f"worker port for pods without a {DEFAULT_WORKER_PORTS_ANNOTATION} annotation",
        "kubernetes.port",
        default=80,
        type=int,
        group=KUBE,
    ),
    Flag(
        "--service-discovery-namespace",
        "namespace to watch (default: all namespaces, needs cluster-wide list/watch)",
        "kubernetes.namespace",
        convert=lambda v: v or None,
        group=KUBE,
    ),
    Flag(
        "--bootstrap-port-annotation",
        "pod annotation holding a prefill pod's bootstrap port",
        "kubernetes.bootstrap_port_annotation",
        default=DEFAULT_BOOTSTRAP_PORT_ANNOTATION,
        group=KUBE,
    ),
    Flag(
        "--worker-ports-annotation",
        "pod annotation listing several worker ports (comma-separated)",
        "kubernetes.worker_ports_annotation",
        default=DEFAULT_WORKER_PORTS_ANNOTATION,
        group=KUBE,
    ),
    Flag(
        "--model-id-from",
        "worker model id from the pod: namespace, label:<key> or annotation:<key>",
        "kubernetes.model_id_from",
        metavar="SOURCE",
        group=KUBE,
    ),
    Flag(
        "--kube-api-server",
        "API server URL (default: in-cluster KUBERNETES_SERVICE_HOST/PORT)",
        "kubernetes.api_server",
        metavar="URL",
        group=KUBE,
    ),
    Flag(
        "--kube-token-file",
        "bearer token file, read before every request (in-cluster: "
        "/var/run/secrets/kubernetes.io/serviceaccount/token)",
        "kubernetes.token_file",
        metavar="PATH",
        group=KUBE,
    ),
    Flag(
        "--kube-ca-file",
        "CA bundle of the API server (in-cluster: "
        "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt)",
        "kubernetes.ca_file",
        metavar="PATH",
        group=KUBE,
    ),
    Flag(
        "--kube-watch-timeout-secs",
        "timeoutSeconds of each watch",
        "kubernetes.watch_timeout_secs",
        default=300,
        type=int,
        group=KUBE,
    ),
    Flag(
        "--kube-stall-timeout-secs",
        "restart a watch that delivers no event or bookmark for this long",
        "kubernetes.stall_timeout_secs",
        default=120.0,
        type=float,
        group=KUBE,
    ),
    Flag(
        "--kube-resync-secs",
        "hand the registry the whole pod-derived set this often",
        "kubernetes.resync_secs",
        default=30.0,
        type=float,
        group=KUBE,
    ),
    Flag(
        "--etcd-endpoints",
        "etcd client URLs (its v3 JSON gateway, e.g. http://127.0.0.1:2379); worker "
        "membership is then read from and written to etcd",
        "etcd.endpoints",
        metavar="URL[,URL]",
        enables="etcd",
        group=ETCD,
    ),
    Flag(
        "--etcd-prefix",
        "key prefix of this router's membership",
        "etcd.prefix",
        default="/trio-pd",
        group=ETCD,
    ),
    Flag(
        "--etcd-lease-ttl-secs",
        "0: workers added here stay until removed; N: they hang on this replica's lease and "
        "vanish N seconds after the replica dies",
        "etcd.lease_ttl_secs",
        default=0,
        type=int,
        group=ETCD,
    ),
    Flag(
        "--etcd-dial-timeout-secs",
        "connecting to etcd",
        "etcd.dial_timeout_secs",
        default=2.0,
        type=float,
        group=ETCD,
    ),
    Flag(
        "--etcd-request-timeout-secs",
        "one etcd call",
        "etcd.request_timeout_secs",
        default=5.0,
        type=float,
        group=ETCD,
    ),
    Flag(
        "--etcd-resync-secs",
        "full re-read of the membership this often, besides the watch",
        "etcd.resync_secs",
        default=30.0,
        type=float,
        group=ETCD,
    ),
)
