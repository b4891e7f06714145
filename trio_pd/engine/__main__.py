"""`python -m trio_pd.engine ...` runs one simulated engine."""

from trio_pd.engine.cli import main

if __name__ == "__main__":
    main()
