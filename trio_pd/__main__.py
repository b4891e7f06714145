"""`python -m trio_pd ...` is the same as the `trio-pd` command."""

from trio_pd.cli.main import main

if __name__ == "__main__":
    main()
