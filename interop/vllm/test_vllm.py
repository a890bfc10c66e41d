"""mmenc's embeddings through vLLM's own code, per family: vLLM's greedy tokens and logprobs with them must be
its answer for the raw images (within harness.TOL, fp32), on the three ways mmenc feeds vLLM; controls
(zeroed embeddings, two images swapped, a planted wrong EC file) must change the answer.

  offline: Encoder.encode -> LLM.generate(multi_modal_data={"image": {"image_embeds", "image_grid_thw"}}),
           for LLaVA-1.5, NeXT and OneVision (mmenc.vllm_inputs.BARE_EMBEDS_ARCHITECTURES) a list of bare
           [tokens, hidden] tensors
  service: mmenc serve /v1/encode (format "vllm", one and two images per request, --frontends too)
           -> the image_embeds content parts, as they come, in vLLM's OpenAI chat request (the LLaVA families: one
           base64 tensor per part, no grid)
  EC files: mmenc serve --ec-storage DIR; vLLM an ec_consumer of DIR (ECExampleConnector), asked with
           image_url parts whose uuid is mmenc's key: the request's uuid, or mmenc's content key
Families vLLM takes EC files from but no image_embeds inputs (mmenc.vllm_inputs.EC_ONLY_ARCHITECTURES) run
the EC tests, and test_embeddings_refused checks that vLLM still refuses their embeddings (when it stops,
the family moves to EMBEDS_ARCHITECTURES). For SAME_LENGTH_EMBEDS_ARCHITECTURES (LLaVA-NeXT, OneVision: vLLM
refuses embeddings of different lengths in one encoder batch) the embedding paths send each test image alone and
two images of one size together (conftest.Stack.embeds_sets), the EC tests keep the two sizes, and
test_mixed_lengths_refused checks vLLM's refusal.
Video (mmenc.vllm_inputs.VIDEO_EMBEDS_ARCHITECTURES): a clip the stack writes (PyAV), encoded by mmenc,
offline as {"video_embeds", "video_grid_thw", Qwen2.5-VL's "second_per_grid_ts", Qwen3-VL's "timestamps"}
and as /v1/encode's video_embeds part in vLLM's chat API, against vLLM's answer for the frames mmenc sampled
(decoded by mmenc, given to vLLM with their indices and fps); controls: zeroed embeddings, and for
Qwen2.5-VL the embeddings without second_per_grid_ts.
"""
import base64

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import (Answer, assert_agree, assert_differ, b64_tensor, chat, chat_body, from_request_output,
                     load_b64_tensor, png_data_url)
from mmenc.vllm_inputs import SAME_LENGTH_EMBEDS_ARCHITECTURES, multi_modal_data, takes_grid, video_multi_modal_data

TEXT = {1: "what is in the image", 2: "compare two images"}


def _generate(stack, images: list[int], data) -> Answer:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True, seed=0)
    prompt = stack.family.user_prompt(TEXT[len(images)], images=len(images))
    return from_request_output(stack.llm.generate({"prompt": prompt, "multi_modal_data": {"image": data}}, params,
                                                  use_tqdm=False)[0])


def _offline_image_answer(stack, images: list[int]) -> Answer:
    return _generate(stack, images, [stack.images[i] for i in images])


def _url_parts(stack, i: int, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": png_data_url(stack.png[i])}}
    return part if uuid is None else {**part, "uuid": uuid}


def _image_answer(stack, images: list[int]) -> Answer:
    """vLLM's own answer (its server, image_url parts): what every path must give."""
    key = tuple(images)
    if key not in stack.answers:
        body = chat_body(stack.folder, [_url_parts(stack, i) for i in images], TEXT[len(images)])
        stack.answers[key] = chat(stack.vllm, body)
    return stack.answers[key]


def _encode(server, stack, images: list[int], uuids=None) -> list[dict]:
    body = {"images": [png_data_url(stack.png[i]) for i in images], "format": "vllm"}
    if uuids is not None:
        body["uuids"] = uuids
    status, reply = server.post("/v1/encode", body)
    assert status == 200, f"mmenc answered {status}: {reply}"
    assert all("error" not in item for item in reply["data"]), reply["data"]
    return reply["data"]


def _needs_embeds(stack) -> None:
    if not stack.takes_embeds:
        pytest.skip(f"vLLM refuses {stack.architecture}'s image embeddings (test_embeddings_refused)")


def _parts(stack, server, images: list[int]) -> list[dict]:
    return [item["image_embeds"] for item in _encode(server, stack, images)]


def _part_tensor(part: dict) -> torch.Tensor:
    """The embeddings of an image_embeds part: {"image_embeds": B64, "image_grid_thw": B64}, or B64 alone."""
    fields = part["image_embeds"]
    return load_b64_tensor(fields["image_embeds"] if isinstance(fields, dict) else fields)


def _with_tensor(part: dict, tensor: torch.Tensor) -> dict:
    """`part` with other embeddings, in its own layout."""
    fields = part["image_embeds"]
    new = {**fields, "image_embeds": b64_tensor(tensor)} if isinstance(fields, dict) else b64_tensor(tensor)
    return {**part, "image_embeds": new}


def _offline_data(stack, images: list) -> object:
    """multi_modal_data["image"] of PIL images in the family's layout (the grid one, or bare tensors)."""
    _, grid = stack.encoder.preprocess(images)
    return multi_modal_data(stack.encoder.encode(images, return_extras=True),
                            grid if takes_grid(stack.architecture) else None)


def _zeroed(data):
    if isinstance(data, dict):
        return {**data, "image_embeds": torch.zeros_like(data["image_embeds"])}
    return [torch.zeros_like(t) for t in data]


def test_offline_encode_to_generate(stack):
    """Encoder.encode -> LLM.generate with multi_modal_data embeddings, one and two images."""
    _needs_embeds(stack)
    for images in stack.embeds_sets:
        data = _offline_data(stack, [stack.images[i] for i in images])
        want = _offline_image_answer(stack, images)
        assert_agree(_generate(stack, images, data), want, f"offline, images {images}")
    assert_differ(_generate(stack, images, _zeroed(data)), want, "offline zeroed embeddings")
    data = _offline_data(stack, [stack.images[i] for i in images[::-1]])
    assert_differ(_generate(stack, images, data), want, "offline images swapped")


def test_offline_and_server_agree(stack):
    """The offline prompt (ChatFamily.user_prompt) is what the server's chat template renders."""
    for images in ([0], [0, 1]):
        assert_agree(_offline_image_answer(stack, images), _image_answer(stack, images), f"offline vs server {images}")


def test_service_image_embeds_parts(stack):
    """/v1/encode's image_embeds parts, unchanged, in vLLM's chat request; every mmenc server of the stack."""
    _needs_embeds(stack)
    for frontends, server in stack.mmenc.items():
        for images in stack.embeds_sets:
            parts = _parts(stack, server, images)
            # as sent; then under fresh uuids, so that vLLM cannot take the EC file mmenc wrote under the
            # part's uuid (its consumer reads that tree): the part's tensors alone must give the answer
            fresh = [{**part, "uuid": stack.uuid("part")} for part in parts]
            for sent, how in ((parts, "as sent"), (fresh, "fresh uuids")):
                assert_agree(chat(stack.vllm, chat_body(stack.folder, sent, TEXT[len(images)])),
                             _image_answer(stack, images), f"service (frontends {frontends}), images {images}, {how}")
        want = _image_answer(stack, stack.pair)
        assert_differ(chat(stack.vllm, chat_body(stack.folder, fresh[::-1], TEXT[2])), want, "service parts swapped")
        # a new uuid again: vLLM's caches are keyed by it
        zeroed = {**_with_tensor(fresh[0], _part_tensor(fresh[0]) * 0), "uuid": stack.uuid("zeroed")}
        assert_differ(chat(stack.vllm, chat_body(stack.folder, [zeroed, fresh[1]], TEXT[2])), want,
                      "service zeroed embeddings")


def test_ec_storage_request_uuids(stack):
    """mmenc writes DIR/<uuid>/encoder_cache.safetensors; vLLM, asked with the same uuids, reads them."""
    uuids = [stack.uuid("request"), stack.uuid("request")]
    items = _encode(stack.mmenc[0], stack, [0, 1], uuids=uuids)
    assert [item["uuid"] for item in items] == uuids
    for uuid, item in zip(uuids, items):
        stored = load_file(stack.ec_dir / uuid / "encoder_cache.safetensors")["ec_cache"]
        assert torch.equal(stored, _part_tensor(item["image_embeds"]))
    body = chat_body(stack.folder, [_url_parts(stack, i, uuid) for i, uuid in enumerate(uuids)], TEXT[2])
    assert_agree(chat(stack.vllm, body), _image_answer(stack, [0, 1]), "EC files under request uuids")


def test_ec_storage_content_keys(stack):
    """Without uuids mmenc keys an image by content (its answer's `uuid`); vLLM asked with that key reads it."""
    keys = [item["uuid"] for item in _encode(stack.mmenc[0], stack, [0, 1])]
    assert all((stack.ec_dir / key / "encoder_cache.safetensors").is_file() for key in keys)
    body = chat_body(stack.folder, [_url_parts(stack, i, key) for i, key in enumerate(keys)], TEXT[2])
    assert_agree(chat(stack.vllm, body), _image_answer(stack, [0, 1]), "EC files under content keys")


def test_ec_storage_planted_file_is_read(stack):
    """A wrong file under a uuid changes vLLM's answer: the consumer reads the file, not the image."""
    right = _encode(stack.mmenc[0], stack, [0])[0]
    embeds = _part_tensor(right["image_embeds"])
    planted = stack.uuid("planted")
    (stack.ec_dir / planted).mkdir()
    save_file({"ec_cache": embeds.flip(0).contiguous()}, str(stack.ec_dir / planted / "encoder_cache.safetensors"))
    body = chat_body(stack.folder, [_url_parts(stack, 0, planted)], TEXT[1])
    assert_differ(chat(stack.vllm, body), _image_answer(stack, [0]), "planted EC file (rows reversed)")


def test_embeddings_refused(stack):
    """vLLM 0.32's reasons for an EC-only family (docs/serving.md quotes them): offline, the embeddings dict is
    parsed as a list of images; through the chat API, the part is refused with HTTP 400."""
    if stack.takes_embeds:
        pytest.skip(f"vLLM takes {stack.architecture}'s image embeddings")
    data = _offline_data(stack, stack.images[:1])
    with pytest.raises(ValueError) as refused:
        _generate(stack, [0], data)
    print(f"{stack.architecture} offline: {refused.value}")
    status, reply = stack.vllm.post("/v1/chat/completions", chat_body(stack.folder, _parts(stack, stack.mmenc[0], [0]),
                                                                      TEXT[1]))
    assert status == 400, (status, reply)
    print(f"{stack.architecture} chat: {reply['error']['message']}")


# vLLM 0.32's embedding schema per SAME_LENGTH_EMBEDS_ARCHITECTURES family: (module, class)
SAME_LENGTH_SCHEMAS = {
    "LlavaNextForConditionalGeneration": ("vllm.model_executor.models.llava_next", "LlavaNextImageEmbeddingInputs"),
    "LlavaOnevisionForConditionalGeneration": ("vllm.model_executor.models.llava_onevision",
                                               "LlavaOnevisionImageEmbeddingInputs"),
}


def test_mixed_lengths_refused(stack):
    """vLLM 0.32's reason for SAME_LENGTH_EMBEDS_ARCHITECTURES (docs/serving.md quotes it): its embedding schema
    ([bn, ifs, hs], ifs not dynamic) refuses mmenc's embeddings of images 0 and 1 (different tile layouts, so
    different lengths) in one encoder batch. Checked on the schema class alone: in the engine the error is raised
    inside its step. When it stops refusing, the family leaves that list and sends images 0 and 1 together."""
    import importlib

    if stack.architecture not in SAME_LENGTH_EMBEDS_ARCHITECTURES:
        pytest.skip(f"{stack.architecture} is not in SAME_LENGTH_EMBEDS_ARCHITECTURES")
    data = _offline_data(stack, stack.images[:2])
    assert data[0].shape[0] != data[1].shape[0], [t.shape for t in data]
    module, name = SAME_LENGTH_SCHEMAS[stack.architecture]
    schema = getattr(importlib.import_module(module), name)
    with pytest.raises(ValueError, match="inconsistent shapes") as refused:
        schema(type="image_embeds", data=data)
    print(f"{stack.architecture}: {refused.value}")
    schema(type="image_embeds", data=[data[0], data[0]])  # one length: taken


VIDEO_TEXT = "describe this picture"


def _needs_video(stack) -> None:
    if not stack.takes_video:
        pytest.skip(f"{stack.architecture}: no video embeddings in this suite")


def _generate_video(stack, data) -> Answer:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True, seed=0)
    prompt = stack.family.user_prompt(VIDEO_TEXT, images=0, videos=1)
    return from_request_output(stack.llm.generate({"prompt": prompt, "multi_modal_data": {"video": data}}, params,
                                                  use_tqdm=False)[0])


def _video(stack):
    """mmenc's encoding of the clip (VideoEmbedding) and vLLM's own answer for the raw video: the frames
    mmenc sampled, decoded by mmenc (PyAV), with their indices and the clip's fps (vLLM samples nothing more:
    do_sample_frames False), so both sides see the same pixels and the same times."""
    if "video" not in stack.answers:
        from mmenc.preprocess.video_decode import probe
        from mmenc.preprocess.video_frames import decode

        (video,) = stack.encoder.encode([str(stack.clip)], return_extras=True)
        data = stack.clip.read_bytes()
        meta = probe(data)
        frames = decode(data, video.video.frames_indices, meta)
        metadata = {"fps": meta.fps, "total_num_frames": meta.total_num_frames, "duration": meta.duration,
                    "frames_indices": list(video.video.frames_indices), "video_backend": "pyav",
                    "width": meta.width, "height": meta.height, "do_sample_frames": False}
        stack.answers["video"] = video, _generate_video(stack, [(frames, metadata)])
    return stack.answers["video"]


def test_offline_video_embeds(stack):
    """Encoder.encode(clip) -> LLM.generate(multi_modal_data={"video": video_multi_modal_data}) gives vLLM's
    answer for the raw frames; zeroed embeddings change it, and so does a wrong Qwen2.5-VL time step (vLLM
    reads second_per_grid_ts beside embeddings for its M-RoPE positions)."""
    _needs_video(stack)
    video, want = _video(stack)
    data = video_multi_modal_data([video])
    assert_agree(_generate_video(stack, data), want, "offline video embeddings")
    assert_differ(_generate_video(stack, {**data, "video_embeds": torch.zeros_like(data["video_embeds"])}), want,
                  "offline zeroed video embeddings")
    if "second_per_grid_ts" in data:
        assert data["second_per_grid_ts"].tolist() == [0.5]
        assert_differ(_generate_video(stack, {k: v for k, v in data.items() if k != "second_per_grid_ts"}), want,
                      "offline video embeddings without second_per_grid_ts (vLLM takes 1.0)")


def test_service_video_embeds_part(stack):
    """/v1/encode of the clip (a data URL, format "vllm") -> its video_embeds part, unchanged, in vLLM's chat
    request: vLLM's answer for the raw video; under a fresh uuid too (not vLLM's EC file of the key)."""
    _needs_video(stack)
    _, want = _video(stack)
    url = "data:video/mp4;base64," + base64.b64encode(stack.clip.read_bytes()).decode()
    status, reply = stack.mmenc[0].post("/v1/encode", {"images": [url], "format": "vllm"})
    assert status == 200 and "error" not in reply["data"][0], reply
    part = reply["data"][0]["video_embeds"]
    fresh = {**part, "uuid": stack.uuid("video")}
    for sent, how in ((part, "as sent"), (fresh, "fresh uuid")):
        assert_agree(chat(stack.vllm, chat_body(stack.folder, [sent], VIDEO_TEXT)), want, f"service video part, {how}")
    fields = fresh["video_embeds"]
    zeroed = {**fresh, "uuid": stack.uuid("video-zeroed"),
              "video_embeds": {**fields, "video_embeds": b64_tensor(load_b64_tensor(fields["video_embeds"]) * 0)}}
    assert_differ(chat(stack.vllm, chat_body(stack.folder, [zeroed], VIDEO_TEXT)), want, "service zeroed video part")
