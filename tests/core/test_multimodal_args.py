"""The multi-modal input flags: ``--limit-mm-per-prompt`` (JSON, the seeds' ``image=16``
form and key by key), ``--mm-processor-kwargs``, ``--disable-mm-preprocessor-cache``,
``--allowed-local-media-path`` and ``--allowed-media-domains``, from the command line,
``EngineArgs`` and ``LLM(...)``; video and audio are refused by name."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.core.argparser import FlexibleArgumentParser
from pagedllm.core.configs.multimodal import DEFAULT_IMAGES_PER_PROMPT, MultiModalConfig
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError

IMAGES_ONLY = "pagedllm takes images only; video/audio are not supported"


@pytest.fixture(scope="module")
def parser():
    from pagedllm.core.plugins import make_plugin_manager

    return EngineArgs.add_cli_args(FlexibleArgumentParser(), make_plugin_manager(env={}))


def config(parser, pm, *argv: str):
    return EngineArgs.from_cli_args(parser.parse_args(list(argv))).create_engine_config(pm)


@pytest.mark.parametrize(
    "argv",
    [
        ["--limit-mm-per-prompt", "image=3"],
        ["--limit-mm-per-prompt", "image=3,video=0"],
        ["--limit-mm-per-prompt", '{"image": 3}'],
        ["--limit-mm-per-prompt", '{"images": 3, "videos": 0}'],
        ["--limit-mm-per-prompt.image", "3"],
    ],
)
def test_the_image_limit_in_every_form(parser, pm, argv):
    assert config(parser, pm, *argv).multimodal_config.limit_per_prompt == {"image": 3}


def test_defaults(parser, pm):
    built = config(parser, pm)
    assert built.multimodal_config.max_images == DEFAULT_IMAGES_PER_PROMPT
    assert built.multimodal_config.mm_processor_kwargs is None
    assert built.multimodal_config.disable_mm_preprocessor_cache is False
    assert built.model_config.allowed_local_media_path == ""
    assert built.model_config.allowed_media_domains is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["image=16,video=2"], f"video: {IMAGES_ONLY}"),
        (['{"audio": 1}'], f"audio: {IMAGES_ONLY}"),
        (['{"image": 2, "videos": 1}'], f"videos: {IMAGES_ONLY}"),
        (['{"vision": 2}'], "unknown modality 'vision'"),
        (['{"image": -1}'], "the limit of 'image' must be an integer >= 0"),
        (['{"image": "many"}'], "the limit of 'image' must be an integer >= 0"),
    ],
)
def test_limits_pagedllm_cannot_honour_are_refused(parser, pm, argv, message):
    with pytest.raises(ConfigError, match=f"--limit-mm-per-prompt=.*{message}"):
        config(parser, pm, "--limit-mm-per-prompt", *argv)


def test_processor_options_are_kept(parser, pm, tmp_path):
    built = config(
        parser,
        pm,
        "--mm-processor-kwargs",
        '{"num_crops": 4}',
        "--disable-mm-preprocessor-cache",
        "--allowed-local-media-path",
        str(tmp_path),
        "--allowed-media-domains",
        "Example.com",
        "upload.wikimedia.org",
    )
    assert built.multimodal_config.mm_processor_kwargs == {"num_crops": 4}
    assert built.multimodal_config.disable_mm_preprocessor_cache is True
    assert built.model_config.allowed_local_media_path == str(tmp_path)
    assert built.model_config.allowed_media_domains == ["example.com", "upload.wikimedia.org"]
    with pytest.raises(SystemExit):  # (argparse: not a JSON object)
        parser.parse_args(["--mm-processor-kwargs", "[1]"])
    with pytest.raises(ConfigError, match=r"mm_processor_kwargs=\[1\] is not a dict"):
        EngineArgs(mm_processor_kwargs=[1]).create_engine_config(pm)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--mm-processor-kwargs=.*give a JSON object"):
        MultiModalConfig(mm_processor_kwargs=[1])  # type: ignore[arg-type]


def test_media_paths_and_domains_are_checked(parser, pm, tmp_path):
    with pytest.raises(ConfigError, match="--allowed-local-media-path=.* not an existing dir"):
        config(parser, pm, "--allowed-local-media-path", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="'example.com/images' is not a host name"):
        config(parser, pm, "--allowed-media-domains", "example.com/images")


def test_the_llm_class_takes_them_as_keywords(tmp_path):
    # (refused while the configuration is built, before any model is looked for)
    with pytest.raises(ConfigError, match=f"video: {IMAGES_ONLY}"):
        LLM(str(tmp_path / "no-model"), limit_mm_per_prompt={"image": 2, "video": 1})
    with pytest.raises(ConfigError, match="--allowed-local-media-path=.* not an existing"):
        LLM(str(tmp_path / "no-model"), allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="mm_processor_kwargs='num_crops=4' is not a dict"):
        LLM(str(tmp_path / "no-model"), mm_processor_kwargs="num_crops=4")
