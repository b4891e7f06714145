"""`python -m trio_pd_testing.engine ...` runs one simulated engine."""

from trio_pd_testing.engine.cli import main

if __name__ == "__main__":
    main()
