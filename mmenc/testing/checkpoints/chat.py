"""Tiny random-weight chat checkpoints that an LLM engine (vLLM) loads and runs, made locally.

What `save_*` in the lineage files write is enough for the tower tests (transformers' model with a
one-layer text model, its tower's width unrelated to the text model's). An engine needs the whole
model to be consistent and runnable: the tower's output width equal to the text model's hidden size,
a head size its attention kernels take (vLLM's CPU attention: a multiple of 32), rotary sections that
fit that head size, the family's special-token ids inside the vocabulary, a tokenizer with those
tokens and the family's chat template, and the published preprocessor_config.json values.
`save_chat_checkpoint(architecture, folder)` writes that for every row of `CHAT_FAMILIES`.

The tokenizer is built here with `tokenizers` (nothing downloaded): a word-level vocabulary of the
family's special tokens and a few words, split on whitespace. Token ids are what an engine compares,
so a real BPE is not needed.
"""
import dataclasses
import json
import pathlib

import torch

from mmenc.testing.checkpoints.base import _save

# Text model: 2 heads of 32 (vLLM's CPU attention needs head sizes that are multiples of 32), one layer.
CHAT_TEXT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32, intermediate_size=64, max_position_embeddings=4096, tie_word_embeddings=False,
                 bos_token_id=None)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
WORDS = ("what is in the image describe this picture compare two images a an of and cat dog red blue green "
         "one two three yes no").split()


@dataclasses.dataclass(frozen=True)
class ChatFamily:
    """One architecture's chat checkpoint.

    config_class: the transformers config class name; vision: its vision_config; text: text_config
        additions to CHAT_TEXT (rotary sections sized for head_dim 32).
    specials: the special tokens, in id order from 0 (ids of the config's token fields come from here);
        token_fields: config field -> special token; eos: the end-of-turn token.
    image_placeholder: what the chat template writes for an image (the family's own markers);
        video_placeholder: for a video ("": the checkpoint's template writes nothing for video parts).
    turn: (role) -> the text opening a turn, with "{role}"; turn_end: closing it; prefix: before the
        first turn.
    preprocessor: the published preprocessor_config.json values (tiny vision sizes leave them as they are,
        but for a fixed-size tower, whose sizes are the tower's); processor: processor_config.json (None: none).
    config: more top-level config fields (e.g. LLaVA's feature layer and strategy).
    renames: (saved prefix, published prefix) of weight names, where transformers' save_pretrained writes
        another layout than the published checkpoints (which vLLM loads).
    """

    config_class: str
    vision: dict
    text: dict
    specials: tuple[str, ...]
    token_fields: dict
    eos: str
    image_placeholder: str
    turn: str
    turn_end: str
    preprocessor: dict
    prefix: str = ""
    video_placeholder: str = ""
    processor: dict | None = None
    config: dict = dataclasses.field(default_factory=dict)
    renames: tuple[tuple[str, str], ...] = ()

    def chat_template(self) -> str:
        """A Jinja chat template in the family's format: string contents, or lists of
        {"type": "image"} / {"type": "video"} / {"type": "text", "text": ...} parts (what vLLM renders).
        The family's own text goes in as string expressions, so that the renderer's trim_blocks (on in
        transformers >= 5.24) cannot eat a newline that follows a block tag."""
        def text(value: str) -> str:
            return "{{ " + json.dumps(value) + " }}" if value else ""

        open_turn, _, close_role = self.turn.partition("{role}")
        turn = text(open_turn) + "{{ m['role'] }}" + text(close_role)
        return (f"{text(self.prefix)}{{% for m in messages %}}{turn}"
                "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                f"{{% if p['type'] in ('image', 'image_url', 'image_embeds') %}}{text(self.image_placeholder)}"
                f"{{% elif p['type'] in ('video', 'video_url', 'video_embeds') %}}{text(self.video_placeholder)}"
                "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
                f"{text(self.turn_end)}{{% endfor %}}{{% if add_generation_prompt %}}"
                f"{text(self.turn.replace('{role}', 'assistant'))}{{% endif %}}")

    def user_prompt(self, text: str, images: int = 1, videos: int = 0) -> str:
        """The prompt the template renders for one user turn of `images` images, `videos` videos, then `text`."""
        media = self.image_placeholder * images + self.video_placeholder * videos
        return (f"{self.prefix}{self.turn.replace('{role}', 'user')}{media}{text}"
                f"{self.turn_end}{self.turn.replace('{role}', 'assistant')}")


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
_QWEN_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
_QWEN_CHAT = dict(specials=_QWEN_SPECIALS, token_fields=_QWEN_TOKENS, eos="<|im_end|>",
                  image_placeholder="<|vision_start|><|image_pad|><|vision_end|>",
                  video_placeholder="<|vision_start|><|video_pad|><|vision_end|>",
                  turn="<|im_start|>{role}\n", turn_end="<|im_end|>\n")
# Qwen2-VL-7B-Instruct's and Qwen2.5-VL-7B-Instruct's preprocessor_config.json (Qwen2.5: same values)
_QWEN2_PRE = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "image_processor_type": "Qwen2VLImageProcessor"}
# Qwen3-VL-*-Instruct: patch 16, mean/std 0.5, size bounds in pixels
_QWEN3_PRE = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
              "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"}
# GLM-4.1V-9B-Thinking
_GLM_PRE = {"size": {"shortest_edge": 12544, "longest_edge": 9633792}, "do_rescale": True, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
            "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor"}
# llava-hf/llava-1.5-7b-hf's preprocessor_config.json, 336 px scaled to the tiny tower's 56, and its processor_config.json
_LLAVA_PRE = {"crop_size": {"height": 56, "width": 56}, "size": {"shortest_edge": 56}, "do_center_crop": True,
              "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 3,
              "rescale_factor": 1 / 255, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
              "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor"}
_LLAVA_PROCESSOR = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                    "image_token": "<image>", "processor_class": "LlavaProcessor"}
# llava-hf/llava-v1.6-mistral-7b-hf's preprocessor_config.json and processor_config.json, 336 px scaled to 56
# (its five canvases of 1 x 2, 2 x 1, 2 x 2, 3 x 1 and 1 x 3 tiles, at the tiny tile size)
_NEXT_PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
_NEXT_PRE = {"aspect_ratio_setting": "anyres", "crop_size": {"height": 56, "width": 56}, "do_center_crop": True,
             "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
             "image_grid_pinpoints": _NEXT_PINPOINTS, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
             "image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
             "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": 56}}
_NEXT_PROCESSOR = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                   "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}
# llava-hf/llava-onevision-qwen2-7b-ov-hf's: 384 px tiles scaled to 56, canvases of 1..6 x 1..6 tiles
_ONEVISION_PINPOINTS = [[56 * a, 56 * b] for a in range(1, 7) for b in range(1, 7)]
_ONEVISION_PRE = {"do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
                  "image_grid_pinpoints": _ONEVISION_PINPOINTS, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "image_processor_type": "LlavaOnevisionImageProcessor",
                  "processor_class": "LlavaOnevisionProcessor", "resample": 3, "rescale_factor": 1 / 255,
                  "size": {"height": 56, "width": 56}}
_ONEVISION_PROCESSOR = {"image_token": "<image>", "num_image_tokens": 16, "processor_class": "LlavaOnevisionProcessor",
                        "video_token": "<video>", "vision_feature_select_strategy": "full"}
_GLM_SPECIALS = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                 "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                 "<|video|>")
_GLM_TOKENS = {"image_token_id": "<|image|>", "video_token_id": "<|video|>",
               "image_start_token_id": "<|begin_of_image|>", "image_end_token_id": "<|end_of_image|>",
               "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>"}

CHAT_FAMILIES: dict[str, ChatFamily] = {
    "Qwen2VLForConditionalGeneration": ChatFamily(
        "Qwen2VLConfig",
        vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, patch_size=14,
                    temporal_patch_size=2, spatial_merge_size=2, in_channels=3, hidden_act="quick_gelu"),
        text=dict(rope_parameters=dict(_ROPE, mrope_section=[4, 6, 6])),
        preprocessor=dict(_QWEN2_PRE, processor_class="Qwen2VLProcessor"), **_QWEN_CHAT),
    "Qwen2_5_VLForConditionalGeneration": ChatFamily(
        "Qwen2_5_VLConfig",
        vision=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=64, patch_size=14,
                    temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
                    in_channels=3, hidden_act="silu"),
        text=dict(rope_parameters=dict(_ROPE, mrope_section=[4, 6, 6])),
        preprocessor=dict(_QWEN2_PRE, processor_class="Qwen2_5_VLProcessor"), **_QWEN_CHAT),
    # DeepStack after blocks 0 and 2: vLLM's image embeddings are [tokens, 64 * 3]
    "Qwen3VLForConditionalGeneration": ChatFamily(
        "Qwen3VLConfig",
        vision=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=64, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36,
                    deepstack_visual_indexes=[0, 2], in_channels=3, hidden_act="gelu_pytorch_tanh"),
        text=dict(rope_parameters=dict(_ROPE, mrope_section=[6, 5, 5], mrope_interleaved=True)),
        preprocessor=_QWEN3_PRE, **_QWEN_CHAT),
    "Glm4vForConditionalGeneration": ChatFamily(
        "Glm4vConfig",
        vision=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=64, image_size=84,
                    patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, hidden_act="silu",
                    rms_norm_eps=1e-5, attention_bias=False),
        text=dict(rope_parameters=dict(_ROPE, mrope_section=[2, 3, 3], partial_rotary_factor=0.5)),
        specials=_GLM_SPECIALS, token_fields=_GLM_TOKENS, eos="<|user|>",
        image_placeholder="<|begin_of_image|><|image|><|end_of_image|>", prefix="[gMASK]<sop>",
        turn="<|{role}|>\n", turn_end="", preprocessor=_GLM_PRE),
    # LLaVA-1.5: CLIP (layer -2, CLS dropped: 4 x 4 = 16 tokens of a 56 px image), projector, Llama
    "LlavaForConditionalGeneration": ChatFamily(
        "LlavaConfig",
        vision=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32, hidden_act="quick_gelu"),
        text=dict(model_type="llama"), specials=("<pad>", "<s>", "</s>", "<image>"),
        token_fields={"image_token_index": "<image>"}, eos="</s>", image_placeholder="<image>\n", prefix="<s>",
        turn="{role}: ", turn_end="\n", preprocessor=_LLAVA_PRE, processor=_LLAVA_PROCESSOR,
        config=dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
        # transformers 5.19 saves the CLIP tower's weights without llava-hf's "vision_model." level
        renames=(("vision_tower.", "vision_tower.vision_model."),)),
    # LLaVA-NeXT: LLaVA-1.5's tower, anyres tiles packed (base tile, unpadded canvas, image_newline), Mistral;
    # the role format of LLaVA-1.5 (not the published [INST] one)
    "LlavaNextForConditionalGeneration": ChatFamily(
        "LlavaNextConfig",
        vision=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32, hidden_act="quick_gelu"),
        text=dict(model_type="mistral", sliding_window=None), specials=("<pad>", "<s>", "</s>", "<image>"),
        token_fields={"image_token_index": "<image>"}, eos="</s>", image_placeholder="<image>\n", prefix="<s>",
        turn="{role}: ", turn_end="\n", preprocessor=_NEXT_PRE, processor=_NEXT_PROCESSOR,
        config=dict(vision_feature_layer=-2, vision_feature_select_strategy="default",
                    image_grid_pinpoints=_NEXT_PINPOINTS),
        renames=(("vision_tower.", "vision_tower.vision_model."),)),
    # LLaVA-OneVision: SigLIP (last layer, every token: 16 per 56 px tile), anyres_max_9, Qwen2
    "LlavaOnevisionForConditionalGeneration": ChatFamily(
        "LlavaOnevisionConfig",
        vision=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                    num_attention_heads=2, image_size=56, patch_size=14, hidden_act="gelu_pytorch_tanh",
                    vision_use_head=False),
        text=dict(model_type="qwen2"), specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"),
        token_fields={"image_token_index": "<image>", "video_token_index": "<video>"}, eos="<|im_end|>",
        image_placeholder="<image>\n", turn="<|im_start|>{role}\n", turn_end="<|im_end|>\n",
        preprocessor=_ONEVISION_PRE, processor=_ONEVISION_PROCESSOR,
        config=dict(vision_feature_layer=-1, vision_feature_select_strategy="full",
                    image_grid_pinpoints=_ONEVISION_PINPOINTS, vision_aspect_ratio="anyres_max_9"),
        renames=(("vision_tower.", "vision_tower.vision_model."),)),
}


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old) and not name.startswith(new):
            return new + name[len(old):]
    return name


def _save_tokenizer(family: ChatFamily, folder: pathlib.Path) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) in `folder`; returns the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*family.specials, "[UNK]", *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(family.specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=family.eos, pad_token=family.specials[0],
                                   unk_token="[UNK]")
    fast.chat_template = family.chat_template()
    fast.save_pretrained(folder)
    return vocab


def save_chat_checkpoint(architecture: str, folder, seed: int = 0) -> pathlib.Path:
    """A tiny `architecture` chat model in `folder` (created): config.json, model.safetensors (float32,
    every weight random with std 1/sqrt(fan_in), norms near 1), tokenizer, chat template and
    preprocessor_config.json. Returns the folder."""
    import transformers

    if architecture not in CHAT_FAMILIES:
        raise ValueError(f"no chat checkpoint for architecture {architecture!r}; known: {sorted(CHAT_FAMILIES)}")
    family = CHAT_FAMILIES[architecture]
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = _save_tokenizer(family, folder)
    text = dict(CHAT_TEXT, vocab_size=64, eos_token_id=vocab[family.eos], pad_token_id=0, **family.text)
    tokens = {field: vocab[token] for field, token in family.token_fields.items()}
    config = getattr(transformers, family.config_class)(vision_config=dict(family.vision), text_config=text,
                                                         tie_word_embeddings=False, dtype=torch.float32, **tokens,
                                                         **family.config)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(std=p[0].numel() ** -0.5)
            else:
                norm = name.endswith("weight") and ("norm" in name or "ln_q" in name)
                p.normal_(std=0.1).add_(1.0 if norm else 0.0)
    _save(model, folder)
    if family.renames:
        from safetensors.torch import load_file, save_file

        (file,) = folder.glob("*.safetensors")
        tensors = {_renamed(k, family.renames): v for k, v in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    (folder / "preprocessor_config.json").write_text(json.dumps(family.preprocessor, indent=2) + "\n")
    if family.processor is not None:
        (folder / "processor_config.json").write_text(json.dumps(family.processor, indent=2) + "\n")
    return folder
