"""One settings object (EncoderSettings): validated once, the Encoder's options, the flags of encode / bench /
serve and docs/cli.md's table all made from it."""
import argparse
import dataclasses
import pathlib

import pytest
import torch

from mmenc.cli.flags import SERVE_END, SERVE_START, TABLE_END, TABLE_START, flag_table, serve_table, settings_from_args
from mmenc.cli.main import build_parser
from mmenc.engine.encoder import Encoder
from mmenc.engine.settings import COMMANDS, EncoderSettings, flag_fields, flag_name
from mmenc.testing.checkpoints import random_pixels

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "cli.md"
SERVING = DOCS.parent / "serving.md"


@pytest.mark.parametrize("doc,start,end,table,command", [
    (DOCS, TABLE_START, TABLE_END, flag_table, "python -m mmenc.cli.flags"),
    (SERVING, SERVE_START, SERVE_END, serve_table, "python -m mmenc.cli.flags serve")], ids=["cli.md", "serving.md"])
def test_docs_flag_tables_are_the_settings(doc, start, end, table, command):
    text = doc.read_text(encoding="utf-8")
    assert start in text and end in text, f"docs/{doc.name} lacks the markers {start} ... {end}"
    documented = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert documented == table(), (f"docs/{doc.name}'s flag table differs from the settings; paste the output of "
                                   f"`{command}` between its markers")


def _parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *flags])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_settings_flags_and_their_defaults(command):
    args = _parse(command)
    for field in flag_fields(command):
        assert getattr(args, field.name) == field.default, f"{command} {flag_name(field)}"
    assert settings_from_args(args) == EncoderSettings()


def test_flags_become_validated_settings():
    args = _parse("bench", "--dtype", "bfloat16", "--mm-encoder-tp-mode", "data", "--custom-ops", "none,+mm_encoder_attn",
                  "--chunk-growth", "inf", "--first-chunk-patches", "64", "--preprocess-resize", "cpu", "--compile")
    settings = settings_from_args(args)
    assert settings.custom_ops == ("none", "+mm_encoder_attn") and settings.chunk_growth == float("inf")
    assert settings.mm_config.custom_ops == ("none", "+mm_encoder_attn") and settings.mm_config.compile
    assert (settings.first_chunk_patches, settings.preprocess_resize, settings.mm_encoder_tp_mode) == (64, "cpu", "data")
    with pytest.raises(SystemExit):
        _parse("serve", "--first-chunk-patches", "64")  # a bench setting: not a serve flag


def test_settings_validate_once_and_normalise():
    assert EncoderSettings(mm_encoder_tp_mode="Weight").mm_encoder_tp_mode == "weights"
    assert EncoderSettings(first_chunk_patches=10**9).first_call_patches == 1 << 16
    assert EncoderSettings(max_batch_patches=64).first_call_patches == 4
    for bad, match in [(dict(dtype="int8"), r"dtype='int8' is not valid"),
                       (dict(tensor_parallel_size=0), r"tensor_parallel_size=0 must be an int >= 1"),
                       (dict(chunk_growth=0.5), r"chunk_growth=0.5 must be a number >= 1"),
                       (dict(custom_ops="all,bogus"), r"custom_ops entry 'bogus' is not valid"),
                       (dict(mm_encoder_tp_mode="pipeline"), r"mm_encoder_tp_mode='pipeline' is not valid"),
                       (dict(preprocess_workers=-1), r"preprocess_workers=-1 must be an int >= 0"),
                       (dict(worker_timeout_s=0), r"worker_timeout_s=0 must be a positive")]:
        with pytest.raises(ValueError, match=match):
            EncoderSettings(**bad)


def test_encoder_takes_settings_and_options(folder):
    settings = EncoderSettings(device="cpu", max_batch_patches=32, custom_ops="none")
    enc = Encoder(folder, settings, max_batch_patches=48)  # options win over the settings object
    assert enc.settings == dataclasses.replace(settings, max_batch_patches=48) and enc.max_batch_patches == 48
    assert enc.mm_config.custom_ops == ("none",)
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    pixels = random_pixels(grid)
    want = Encoder(folder, device="cpu").encode_pixels(pixels, grid)
    got = enc.encode_pixels(pixels, grid)  # every CustomOp on its plain-PyTorch forward: the same embeddings
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"unknown options \['max_batch'\]"):
        Encoder(folder, device="cpu", max_batch=3)
    with pytest.raises(TypeError, match=r"settings is str 'auto'"):
        Encoder(folder, "auto")


def test_serve_flags_are_serve_settings():
    from mmenc.cli.serve import settings_from_args as serve_settings
    from mmenc.serving.settings import ServeSettings

    assert serve_settings(_parse("serve")) == ServeSettings()
    got = serve_settings(_parse("serve", "--port", "9001", "--cache-bytes", "512MiB", "--max-request-bytes", "1G",
                                "--shutdown-timeout", "5", "--bucket-batches", "on", "--preprocess-threads", "3"))
    assert (got.port, got.cache_bytes, got.max_request_bytes) == (9001, 512 << 20, 10 ** 9)
    assert (got.shutdown_timeout_s, got.bucket_batches, got.preprocess_threads) == (5.0, "on", 3)
    with pytest.raises(ValueError, match=r"--cache-bytes='lots' is not a size"):
        serve_settings(_parse("serve", "--cache-bytes", "lots"))
    assert ServeSettings(cache_bytes="2GiB").cache_bytes == 2 << 30  # the same parsing from Python
