"""The chunk codecs for zarr-python, registered as the ``zarr.codecs`` entry points ``routelog.ranked_gaps`` (format 2)
and ``routelog.ranked_context`` (revision 3.1: only opens, its chunks need their part's model).

With routelog installed, ``zarr.open_array`` on a part's ``routing`` (or ``streams/<name>``) array returns the
expert IDs ``[num_moe_layers, n_rows, K]`` directly; routelog's own readers call :mod:`routelog.format.ranked` without
going through zarr (see :mod:`routelog.format.shard` for why). A chunk that does not decode, or decodes to a row that is
no valid top-k set (other than zarr's fill value in a row the codec kept as an exception: edge padding), raises
:class:`routelog.errors.CorruptDataError` instead of handing zarr made-up routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import JSON, parse_named_configuration

from routelog.errors import CorruptDataError
from routelog.format import context, ranked
from routelog.format.limits import MAX_EXPERTS

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


@dataclass(frozen=True)
class RankedGapsCodec(ArrayBytesCodec):
    """Array -> bytes: a chunk of top-k expert IDs ``[layers, rows, K]`` to :func:`routelog.format.ranked.encode`'s
    compressed bytes (crc32c follows it in the codec chain). ``level`` is zstd's, used when encoding only."""

    is_fixed_size = False
    codec_name: ClassVar[str] = ranked.RANKED_CODEC

    num_experts: int
    level: int

    def __init__(self, *, num_experts: int, level: int = 3) -> None:
        if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
            raise ValueError(f"{self.codec_name}: num_experts must be an integer in [1, {MAX_EXPERTS}]")
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"{self.codec_name}: level must be a zstd level in [-7, 22]")
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "level", level)

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, configuration = parse_named_configuration(data, cls.codec_name)
        return cls(**configuration)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, JSON]:
        return {"name": self.codec_name, "configuration": {"num_experts": self.num_experts, "level": self.level}}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        native = dtype.to_native_dtype()
        if len(shape) != 3 or native not in (np.dtype(np.uint8), np.dtype(np.uint16)):
            raise ValueError(f"{self.codec_name} encodes [layers, rows, K] arrays of uint8 or uint16 IDs")

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        dtype = chunk_spec.dtype.to_native_dtype()
        shape = tuple(int(n) for n in chunk_spec.shape)
        data = np.asarray(chunk_bytes.as_numpy_array(), dtype=np.uint8)
        try:  # zarr decodes whole chunks: edge padding may hold its fill value (stored as exceptions), and only that
            ids: Any = ranked.decode(
                data,
                (shape[0], shape[1], shape[2]),
                dtype,
                self.num_experts,
                accept="sets_or_fill",
                fill_value=int(chunk_spec.fill_value),
            )
        except ranked.RankedFormatError as exc:
            raise CorruptDataError(
                f"{ranked.RANKED_CODEC} (num_experts {self.num_experts}): an inner chunk of shape {list(shape)} "
                f"cannot be decoded ({exc})"
            ) from exc
        return chunk_spec.prototype.nd_buffer.from_ndarray_like(ids.astype(dtype, copy=False))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        ids = np.ascontiguousarray(chunk_array.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(ranked.encode(ids, self.num_experts, level=self.level))

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        raise NotImplementedError  # variable: repeats and skew shrink it


class RankedContextCodec(RankedGapsCodec):
    """The ``routelog.ranked_context`` chunks' entry in zarr's codec registry (the configuration of
    :class:`RankedGapsCodec`), so ``zarr.open_array`` opens such an array (its metadata, shape and attributes); its
    chunks decode only with their part's model and the token ids of their rows (:mod:`routelog.format.context`),
    which a chunk's bytes do not carry: reading one through zarr raises an error that says to read the part with
    routelog."""

    codec_name: ClassVar[str] = context.CONTEXT_CODEC

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        raise NotImplementedError(
            f"{context.CONTEXT_CODEC} chunks decode with their part's model and the token ids of their rows: read the "
            "part with routelog (routelog.open_store(url).step(step).read_many(...))"
        )

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        raise NotImplementedError(f"{context.CONTEXT_CODEC} arrays are written by routelog's writers only")
