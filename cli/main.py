"""The `gen` command: generate text, and subcommands (train, eval, bench, convert)."""
from __future__ import annotations

import click

from cli.convert import convert_cmd
from cli.eval import eval_cmd
from cli.train import train_cmd


@click.group()
def main():
    """Run a decoder-only language model with softmax or linear attention."""


main.add_command(train_cmd)
main.add_command(eval_cmd)
main.add_command(convert_cmd)

if __name__ == "__main__":
    main()
