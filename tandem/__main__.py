"""``python -m tandem run ...``: the ``tandem`` command without the console script."""

from tandem.launch.cli import command

if __name__ == "__main__":
    command()
