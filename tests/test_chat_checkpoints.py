"""The chat checkpoints an LLM engine loads (mmenc.testing.checkpoints.chat; the vLLM interop suite in
interop/vllm/ runs them in vLLM): their tokenizer renders the family's chat template exactly as
ChatFamily.user_prompt writes it, the special tokens are single tokens whose ids are the config's, the
tower's output width is the text model's hidden size, and mmenc loads the tower and its processor."""
import json

import numpy as np
import pytest
from PIL import Image

from mmenc.testing.checkpoints.chat import CHAT_FAMILIES, save_chat_checkpoint

pytest.importorskip("transformers")


@pytest.mark.parametrize("architecture", sorted(CHAT_FAMILIES))
def test_chat_checkpoint_is_consistent(architecture, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from mmenc import Encoder

    family = CHAT_FAMILIES[architecture]
    folder = save_chat_checkpoint(architecture, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for images in (1, 2):
        content = [{"type": "image"}] * images + [{"type": "text", "text": "what is in the image"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        assert text == family.user_prompt("what is in the image", images=images)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False).count(family.turn.replace("{role}", "assistant")) == 1
    config = AutoConfig.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    for field, token in family.token_fields.items():
        assert getattr(config, field) == vocab[token], (field, token)
        assert tokenizer.encode(token, add_special_tokens=False) == [vocab[token]], token
    assert max(vocab.values()) < config.text_config.vocab_size
    assert config.text_config.head_dim % 32 == 0  # vLLM's CPU attention takes multiples of 32
    assert json.loads((folder / "preprocessor_config.json").read_text()) == family.preprocessor
    with Encoder(str(folder), dtype="float32", device="cpu") as enc:
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (84, 112, 3), dtype=np.uint8))
        (embeddings,) = enc.encode([image])
    assert embeddings.shape[1] == config.text_config.hidden_size


def test_unknown_architecture_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="no chat checkpoint for architecture 'Nope'; known: .*Qwen2VL"):
        save_chat_checkpoint("Nope", tmp_path)
