"""`python -m trio_pd_testing` is the `trio-pd-testing` command."""

from trio_pd_testing.cli import main

if __name__ == "__main__":
    main()
