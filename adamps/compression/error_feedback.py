"""Strom's threshold quantization with error feedback, per pushed tensor (Interspeech 2015,
2.4-2.6), on the trainer side. Owned by the push thread: no locks.

Each tensor pushed compressed keeps a **residual** (float32, its size): every push adds the
tensor's gradient to it; the elements whose residual reaches the threshold ``tau`` are sent as
``+tau`` or ``-tau`` and ``tau`` is taken out of them; everything else stays for later pushes. So
at every moment ``sum of what was sent + residual == sum of the gradients`` (up to float32
rounding), and small but persistent gradient elements are sent eventually, only less often.

``tau`` is fixed per tensor (as in the paper) or adaptive: the magnitude that sends a target
fraction of the tensor's elements in this push.

Per push and tensor the smallest of three forms is sent, and each choice is counted:

- ``vectors``: a fully connected weight's activation/error vectors (Adam 3.2.6), when they are
  smaller than its compressed update; they are exact, so the residual is left as it was;
- ``compressed``: per shard, tau and the sent elements (uint32 words, or Golomb-Rice coded gaps);
- ``dense``: the whole residual plus gradient, exact, when the compressed form would not be
  smaller (e.g. a tiny bias); the residual is then zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adamps.compression import codec
from adamps.layout import Shard

CODINGS = ("words", "rice")


@dataclass
class Encoded:
    """One tensor's compressed update: per shard id, the wire map of push_compressed."""

    shards: dict[str, dict[str, Any]]
    tau: float
    sent: int  #: elements sent
    nbytes: int  #: payload bytes (words or Rice bytes, tau and header per shard)


class TensorCompressor:
    """The residual of one tensor and its threshold rule."""

    def __init__(
        self,
        name: str,
        shards: Sequence[Shard],
        *,
        tau: float | None = None,
        fraction: float = 0.01,
        coding: str = "words",
    ) -> None:
        if coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, got {coding!r}")
        if tau is None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.name = name
        self.shards = list(shards)
        self.size = sum(s.size for s in self.shards)
        self.fixed_tau = tau
        self.fraction = fraction
        self.coding = coding
        #: gradient mass not sent yet (float32, flat)
        self.residual = np.zeros(self.size, np.float32)
        #: the candidate residual of a push being decided, and a buffer for magnitudes
        self._cand = np.zeros(self.size, np.float32)
        self._mag = np.empty(self.size, np.float32)
        self._starts = np.array([s.start for s in self.shards], np.int64)
        self.last_tau = 0.0

    def residual_norm(self) -> float:
        return float(np.linalg.norm(self.residual))

    def tau_for(self, r: np.ndarray) -> float:
        if self.fixed_tau is not None:
            return self.fixed_tau
        return codec.adaptive_tau(r, self.fraction, self._mag)

    def offer(
        self, grad: np.ndarray, alternative: int | None = None
    ) -> Encoded | np.ndarray | None:
        """Adds ``grad`` (flat or any shape of the tensor's size, float32) and decides the form:

        - an :class:`Encoded` update (the residual keeps what was not sent);
        - a dense float32 array (residual + grad, exact; the residual becomes 0) when the
          compressed form would take at least the dense bytes;
        - None when ``alternative`` (the bytes of another exact form, e.g. fc vectors) is not
          larger than the compressed form: the caller sends that instead and the residual is
          left unchanged."""
        g = grad.reshape(-1)
        cand = self._cand
        np.add(self.residual, g, out=cand)
        tau = self.tau_for(cand)
        if tau <= 0.0:  # an all-zero residual: nothing to send
            self.residual, self._cand = cand, self.residual
            return Encoded({}, 0.0, 0, 0)
        idx, neg = codec.quantize(cand, tau, self._mag)
        enc = self._encode(idx, neg, tau)
        dense_bytes = 4 * self.size
        if alternative is not None and alternative <= min(enc.nbytes, dense_bytes):
            return None  # cand is discarded: the residual stays as it was
        if enc.nbytes >= dense_bytes:
            # cand was quantized: send residual + grad exactly instead
            exact = np.add(self.residual, g)
            self.residual.fill(0.0)
            return exact
        self.residual, self._cand = cand, self.residual
        self.last_tau = tau
        return enc

    def _encode(self, idx: np.ndarray, neg: np.ndarray, tau: float) -> Encoded:
        cuts = np.searchsorted(idx, self._starts)
        cuts = np.append(cuts, idx.size)
        out: dict[str, dict[str, Any]] = {}
        nbytes = 0
        for i, s in enumerate(self.shards):
            lo, hi = int(cuts[i]), int(cuts[i + 1])
            if lo == hi:
                continue
            local = idx[lo:hi] - s.start
            sg = neg[lo:hi]
            if self.coding == "rice":
                data, k = codec.rice_encode(local, sg, size=s.size)
                out[s.id] = {
                    "tau": tau,
                    "n": hi - lo,
                    "k": k,
                    "rice": np.frombuffer(data, np.uint8),
                }
                nbytes += len(data) + 9  # + tau (4), n (4), k (1)
            else:
                out[s.id] = {"tau": tau, "words": codec.pack_words(local, sg)}
                nbytes += codec.words_size(hi - lo)
        return Encoded(out, tau, int(idx.size), nbytes)


@dataclass
class PushStats:
    """What one push's compression did (for the metrics)."""

    choices: dict[str, int] = field(
        default_factory=lambda: {"vectors": 0, "compressed": 0, "dense": 0}
    )
    sent_elements: int = 0
    elements: int = 0  #: elements of the tensors offered to the compressor
    bytes_sent: int = 0
    bytes_uncompressed: int = 0  #: what the same tensors take without compression


class Compressor:
    """Every pushed tensor's :class:`TensorCompressor`, created on first use."""

    def __init__(
        self,
        shards_of: Mapping[str, Sequence[Shard]],
        *,
        fraction: float = 0.01,
        taus: Sequence[str] = (),
        coding: str = "words",
    ) -> None:
        self.shards_of = shards_of
        self.fraction = fraction
        self.default_tau, self.taus = codec.parse_taus(taus)
        self.coding = coding
        self.tensors: dict[str, TensorCompressor] = {}

    def of(self, name: str) -> TensorCompressor:
        tc = self.tensors.get(name)
        if tc is None:
            tc = self.tensors[name] = TensorCompressor(
                name,
                self.shards_of[name],
                tau=self.taus.get(name, self.default_tau),
                fraction=self.fraction,
                coding=self.coding,
            )
        return tc

    def add_residuals(self, params: np.ndarray, slices: Mapping[str, slice], scale: float) -> None:
        """``params[tensor] += scale * residual`` for every tensor: the replica's local copy keeps
        the gradient it has not sent yet (like the pushes still queued), so installing fetched
        weights does not make it forget, and compute again, its own unsent updates.

        Called from the main thread while the push thread may be compressing: a residual is
        never changed in place by a compressed push (the new one replaces it), so this reads
        the residual before or after a push, at worst a racing dense fallback's zeroing (the
        benign races of Hogwild)."""
        s = np.float32(scale)
        for name, tc in list(self.tensors.items()):
            params[slices[name]] += s * tc.residual

    def compress(self, parts: Sequence[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], PushStats]:
        """Rewrites a push's parts (``("fc", name, a, e)`` / ``("dense", name, gradient)``, in
        gradient units, see trainer.packing.push_parts) into the smallest form per tensor:
        ``("fc", ...)``, ``("compressed", name, Encoded)`` or ``("dense", name, values)``."""
        out: list[tuple[Any, ...]] = []
        st = PushStats()
        for part in parts:
            kind, name = part[0], part[1]
            tc = self.of(name)
            st.elements += tc.size
            if kind == "fc":
                a, e = part[2], part[3]
                vec_bytes = a.nbytes + e.nbytes
                res = tc.offer(e.T @ a, alternative=vec_bytes)
                st.bytes_uncompressed += vec_bytes
            else:
                g = part[2]
                res = tc.offer(g)
                st.bytes_uncompressed += g.nbytes
            if res is None:
                out.append(part)
                st.choices["vectors"] += 1
                st.sent_elements += tc.size  # vectors carry the whole update
                st.bytes_sent += vec_bytes
            elif isinstance(res, Encoded):
                if res.shards:
                    out.append(("compressed", name, res))
                st.choices["compressed"] += 1
                st.sent_elements += res.sent
                st.bytes_sent += res.nbytes
            else:
                shape = part[2].shape if kind == "dense" else (part[3].shape[1], part[2].shape[1])
                out.append(("dense", name, res.reshape(shape)))
                st.choices["dense"] += 1
                st.sent_elements += tc.size
                st.bytes_sent += res.nbytes
        return out, st
