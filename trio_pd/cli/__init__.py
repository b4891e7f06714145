"""The command line: `trio-pd serve | launch`. The top layer."""
