"""Images for vision-language models (Qwen2-VL, Qwen2.5-VL): the processor, image decoding, placeholders.

**The processor.** transformers' ``Qwen2VLProcessor`` insists on a video processor, which needs
torchvision, and no torchvision wheel on the registry loads against the CPU torch build (docs/multimodal.md).
rlctl does not need it: :class:`VisionProcessor` is the model's own image processor
(``AutoImageProcessor``: the PIL backend without torchvision, torchvision's where installed) and its
tokenizer, and does the one thing the HF processor adds, the same way: each image's placeholder token
(``<|image_pad|>``) becomes ``grid_t * grid_h * grid_w / merge_size**2`` copies, one per merged patch.

**Placeholders in the data.** verl's layout writes ``<image>`` in the prompt text, one per entry of the row's
``images`` column; the HF chat format has ``{"type": "image"}`` content parts (:func:`rlctl.data.sft.checked_messages`
turns them into ``<image>`` too). Either way the k-th ``<image>`` is the k-th image of the row, and becomes the
model's vision span ``<|vision_start|><|image_pad|><|vision_end|>`` before tokenization.

**Images.** An entry of ``images`` is encoded bytes, ``{"bytes": ..., "path": ...}`` (how ``datasets``' Image
feature stores one in Parquet), a file path (relative paths are read beside the data file) or a PIL image. A
missing file, undecodable bytes or more than ``data.max_image_pixels`` pixels make the row a bad row.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlctl.errors import UserError

IMAGE_MARK = "<image>"  # verl's placeholder: the k-th one is the row's k-th image
IMAGES_FIELD = "images"


class BadImage(Exception):
    """An image that cannot be used; the row is a bad row (rlctl.data.sft.BadRow carries the message)."""


def is_vision_config(config) -> bool:
    """Whether a transformers config (or config.json dict) is a vision-language model's (it has a vision tower)."""
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """The transformers auto class of a config: image-text-to-text for a vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


@dataclass
class VisionProcessor:
    """A VL model's image processor and tokenizer; see the module docstring."""

    tokenizer: Any
    image_processor: Any
    image_token: str = "<|image_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.image_token)

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 2))

    @property
    def placeholder(self) -> str:
        """What one ``<image>`` becomes in the text before tokenization."""
        return self.vision_start + self.image_token + self.vision_end

    def stamp(self) -> dict:
        """What the processed pixels depend on (for the data cache key)."""
        return {"image_processor": self.image_processor.to_dict(), "class": type(self.image_processor).__name__}

    def process(self, images: list) -> tuple[np.ndarray, np.ndarray]:
        """``pixel_values`` float32 ``[patches, C * T * P * P]`` and ``image_grid_thw`` int64 ``[images, 3]``."""
        out = self.image_processor(images=images, return_tensors="np")
        return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)

    def tokens_per_image(self, grid_thw: np.ndarray) -> list[int]:
        return [int(np.prod(g)) // self.merge_size**2 for g in grid_thw]

    def expand(self, ids: list[int], grid_thw: np.ndarray, mask: list[int] | None = None):
        """``ids`` with the k-th image token repeated once per merged patch of image k (``mask`` alongside).

        BadImage when the text holds another number of image tokens than there are images."""
        tid = self.image_token_id
        counts = self.tokens_per_image(grid_thw)
        at = [j for j, t in enumerate(ids) if t == tid]
        if len(at) != len(counts):
            raise BadImage(f"{len(at)} image placeholders but {len(counts)} images")
        new_ids, new_mask, k, prev = [], [], 0, 0
        for j in at:
            new_ids += ids[prev:j] + [tid] * counts[k]
            if mask is not None:
                new_mask += mask[prev:j] + [mask[j]] * counts[k]
            prev, k = j + 1, k + 1
        new_ids += ids[prev:]
        if mask is not None:
            new_mask += mask[prev:]
        return new_ids, (new_mask if mask is not None else None)


def load_processor(path: str, tokenizer) -> VisionProcessor:
    """The image processor saved beside a VL model (``preprocessor_config.json``) with ``tokenizer``."""
    from transformers import AutoImageProcessor

    try:
        image_processor = AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot load the image processor of '{path}' (preprocessor_config.json): {str(e).splitlines()[0]}"
        ) from None
    vp = VisionProcessor(tokenizer, image_processor)
    for token in (vp.image_token, vp.vision_start, vp.vision_end):
        if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise UserError(f"the tokenizer of '{path}' has no {token} token; is it the VL model's tokenizer?")
    return vp


def save_processor(vp: VisionProcessor, out_dir: str | Path) -> None:
    """Write the image processor's files (the tokenizer is written with the model's other metadata)."""
    vp.image_processor.save_pretrained(str(out_dir))


# ---------------------------------------------------------------------------------------------
# Images of a row


def row_image_values(row: dict, field: str = IMAGES_FIELD) -> list:
    """The row's images column as a list (absent or null: no images)."""
    value = row.get(field)
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return [value]  # one image rather than a list of them


def decode_image(value, *, max_pixels: int, base_dir: Path | None = None):
    """One entry of an images column as an RGB PIL image; BadImage with the reason."""
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    else:
        data, path = _image_source(value)
        if data is None:
            p = Path(path).expanduser()
            if not p.is_absolute() and base_dir is not None and not p.exists():
                p = base_dir / p
            if not p.is_file():
                raise BadImage(f"image file not found: {path}")
            data = p.read_bytes()
        image = _open_image(data, max_pixels)
    width, height = image.size
    if max_pixels and width * height > max_pixels:
        raise BadImage(
            f"an image has {width}x{height} pixels, more than data.max_image_pixels={max_pixels} "
            f"(resize it, or raise the limit)"
        )
    try:
        return image.convert("RGB")
    except Exception:  # noqa: BLE001 (truncated files fail when the pixels are read)
        raise BadImage("an image could not be decoded") from None


def _open_image(data: bytes, max_pixels: int):
    """The image's header read (its pixels are decoded later). PIL refuses a header of more than twice
    its ``MAX_IMAGE_PIXELS`` (a decompression bomb) before anyone sees the size; ``data.max_image_pixels``
    is rlctl's own limit on the same thing, so such an image is read again without PIL's, and its size is
    what the bad-row reason names (a user looks for a corrupt file otherwise)."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        if not max_pixels:
            raise BadImage(
                f"an image is larger than PIL's decompression-bomb limit of {2 * Image.MAX_IMAGE_PIXELS} pixels "
                f"(resize it, or set data.max_image_pixels)"
            ) from None
    except Exception:  # noqa: BLE001 (PIL raises several types for bad data)
        raise BadImage("an image could not be decoded") from None
    saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # the header only: max_pixels is checked next
    try:
        return Image.open(io.BytesIO(data))
    except Exception:  # noqa: BLE001
        raise BadImage("an image could not be decoded") from None
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _image_source(value) -> tuple[bytes | None, str]:
    """(encoded bytes, or None and a path) of an images-column entry."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), ""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"]), ""
        if isinstance(value.get("path"), str) and value["path"]:
            return None, value["path"]
        if isinstance(value.get("image"), str):  # HF chat parts: {"type": "image", "image": PATH}
            return None, value["image"]
    if isinstance(value, str) and value:
        return None, value.removeprefix("file://")
    raise BadImage("an entry of 'images' is neither bytes, a path nor {'bytes': ..., 'path': ...}")


def row_images(row: dict, *, max_pixels: int, base_dir: Path | None = None) -> list:
    """Every image of a row, decoded (BadImage for the first that cannot be used)."""
    return [decode_image(v, max_pixels=max_pixels, base_dir=base_dir) for v in row_image_values(row)]


def data_dir(path: str) -> Path | None:
    """Where relative image paths of a data source are read: the data file's directory."""
    p = Path(path).expanduser()
    return p if p.is_dir() else p.parent if p.exists() else None


def part_image(part: dict) -> Any:
    """The image an HF chat content part carries inline (``{"type": "image", "image": PATH or bytes}``), or None."""
    for key in ("image", "url", "path"):
        if part.get(key) not in (None, ""):
            return part[key]
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def inline_images(messages) -> list:
    """The images carried inside the content parts of raw chat messages, in order (those with no value skipped)."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if is_image_part(part) and (value := part_image(part)) is not None:
                out.append(value)
    return out


def has_images(row: dict, messages) -> bool:
    """Whether a row holds images: an images column or image content parts."""
    if row_image_values(row):
        return True
    return any(
        is_image_part(p)
        for m in (messages if isinstance(messages, list) else [])
        if isinstance(m, dict)
        for p in (m.get("content") if isinstance(m.get("content"), list) else [])
    )


def replace_marks(text: str, spans: list[tuple[int, int]], new: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with every :data:`IMAGE_MARK` replaced by ``new``, and character ``spans`` moved to match."""
    starts = []
    at = text.find(IMAGE_MARK)
    while at >= 0:
        starts.append(at)
        at = text.find(IMAGE_MARK, at + len(IMAGE_MARK))
    if not starts:
        return text, spans
    grow = len(new) - len(IMAGE_MARK)

    def moved(pos: int) -> int:
        return pos + grow * sum(1 for s in starts if s < pos)

    return text.replace(IMAGE_MARK, new), [(moved(s), moved(e)) for s, e in spans]


def row_pixels(row: dict, messages, vp: VisionProcessor, *, count: int, max_pixels: int, base_dir: Path | None):
    """The processed images of a row whose text holds ``count`` image marks: (pixel_values, image_grid_thw),
    or None when it has no images. BadImage when the counts differ or an image cannot be used."""
    values = row_image_values(row) or inline_images(messages)
    if len(values) != count:
        raise BadImage(f"{count} <image> placeholders but {len(values)} images")
    if not values:
        return None
    images = [decode_image(v, max_pixels=max_pixels, base_dir=base_dir) for v in values]
    try:
        return vp.process(images)
    except Exception as e:  # noqa: BLE001 (the processor refuses e.g. extreme aspect ratios with ValueError)
        raise BadImage(f"the image processor refused an image ({str(e).splitlines()[0][:80]})") from None
