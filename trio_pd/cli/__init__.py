"""The command line: `trio-pd serve | engine | demo`. The top layer: it alone imports
`trio_pd.testing` (the simulator and the demo)."""
