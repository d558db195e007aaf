"""`gen convert`: rewrite checkpoints from other projects in the Hugging Face layout."""
from __future__ import annotations

from pathlib import Path

import click

from cli.common import fail, run_guarded
from models.hf_dir import remove_model_files
from models.llama2c import convert_llama2c


@click.group("convert", short_help="Convert a llama2.c checkpoint to a Hugging Face directory.")
def convert_cmd():
    """Convert a checkpoint to a Hugging Face Llama layout directory."""


@convert_cmd.command("llama2c")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False),
              help="a SentencePiece tokenizer.model to copy into OUT_DIR")
@click.option("--force", is_flag=True, help="overwrite a model already in OUT_DIR")
@click.option("--progress/--no-progress", default=True, show_default=True)
def llama2c_cmd(src, out_dir, tokenizer, force, progress):
    """Convert a llama2.c checkpoint SRC (legacy or version 1) into OUT_DIR."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        held = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        fail(f"{out_dir}: is not empty (holds {held}); pass --force to replace the model files in it")

    # --force: the older model's files go once SRC and the tokenizer have been read (--tokenizer
    # OUT/tokenizer.model is kept, then taken)
    cfg = run_guarded(lambda: convert_llama2c(src, out_dir, tokenizer_path=tokenizer, progress=progress,
                                              before_writing=lambda: remove_model_files(out, keep=(src, tokenizer))))
    click.echo(f"wrote {out_dir}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
               f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv), vocab {cfg.vocab_size}", err=True)
