"""trio_pd's testing face, as `trio.testing` is trio's: the PD engine simulator (`engine`), the
demo, and (`sglang`) the launcher of a real SGLang PD pair on a CPU. May import any layer;
only the CLI and the tests import it."""
