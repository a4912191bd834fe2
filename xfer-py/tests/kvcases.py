"""KV caches shaped like vLLM's and SGLang's (numpy, or torch on a GPU) for the tests of
xfer.kv: the shapes of both sides of each case, filling prefill's caches from a logical
cache, and the decode caches a request must leave."""

import numpy as np

from xfer import kv

# name: (kv_heads, layers, head_dim, prefill side, decode side); a side is
# (backend, kv_layout, tp, num_blocks, block_size).
CASES = {
    "tp2-nhd-to-tp4-nhd": (4, 3, 8, ("flash_attn", "NHD", 2, 24, 8), ("flash_attn", "NHD", 4, 40, 4)),
    "tp4-hnd-to-tp1-nhd": (4, 3, 8, ("flashinfer", "HND", 4, 20, 8), ("flashinfer", "NHD", 1, 20, 8)),
    "tp2-nhd-to-tp4-hnd-replicated": (2, 2, 8, ("flashinfer", "NHD", 2, 16, 4), ("flashinfer", "HND", 4, 12, 8)),
    "mla-tp2-to-tp4": (1, 2, 24, ("mla", "NHD", 2, 20, 8), ("mla", "NHD", 4, 12, 16)),
}


def layer_names(layers):
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


class RankCache:
    """One rank's per-layer caches: `phys` numpy arrays in memory order (what the tensors'
    memory holds), `tensors` the engine's view of them (numpy, or torch on `device`)."""

    def __init__(self, case, side, rank, device="cpu"):
        heads, layers, head_dim, pre, dec = CASES[case]
        self.backend, self.kv_layout, self.tp, nb, bs = pre if side == "prefill" else dec
        self.rank = rank
        self.heads = kv.heads_for_rank(heads, self.tp, rank)
        self.nb, self.bs, self.layers = nb, bs, layers
        self.total_heads = heads
        h = self.heads[1] - self.heads[0]
        phys_shape = {
            ("flash_attn", "NHD"): (2, nb, bs, h, head_dim),
            ("flashinfer", "NHD"): (nb, 2, bs, h, head_dim),
            ("flashinfer", "HND"): (nb, 2, h, bs, head_dim),
            ("mla", "NHD"): (nb, bs, head_dim),
        }[(self.backend, self.kv_layout)]
        self.phys = [np.zeros(phys_shape, np.float16) for _ in range(layers)]
        self.device = device
        if device == "cpu":
            mem = self.phys
        else:
            import torch  # noqa: PLC0415

            mem = [torch.from_numpy(p).to(device) for p in self.phys]
        self.memory = mem
        self.names = layer_names(layers)

    def kv_caches(self):
        """vLLM's kv_caches dict: the logical views (HND's permuted)."""
        perm = (0, 1, 3, 2, 4) if self.kv_layout == "HND" else None
        out = {}
        for n, t in zip(self.names, self.memory, strict=True):
            if perm is None:
                out[n] = t
            else:
                out[n] = t.permute(*perm) if hasattr(t, "permute") else t.transpose(perm)
        return out

    def cache(self):
        return kv.cache_from_vllm(self.kv_caches(), self.total_heads, self.tp, self.rank, self.backend, self.kv_layout)

    def cells(self, arr):
        """A uint8 view of physical array `arr`, indexed [component, block, slot, local head, byte]."""
        v = arr.view(np.uint8)
        if self.backend == "flash_attn":
            return v
        if self.backend == "mla":
            return v[np.newaxis, :, :, np.newaxis, :]
        if self.kv_layout == "HND":
            v = v.transpose(0, 1, 3, 2, 4)
        return np.moveaxis(v, 1, 0)

    def put(self, arrays, table, num_tokens, logical):
        """Writes the request's tokens of `logical` [layer, comp, token, head, byte] into
        `arrays` (physical, per layer) through block table `table`."""
        t = np.arange(num_tokens)
        blocks = np.asarray(table, dtype=np.int64)[t // self.bs]
        slots = t % self.bs
        h0, h1 = self.heads
        for layer, arr in enumerate(arrays):
            self.cells(arr)[:, blocks, slots] = logical[layer][:, :, h0:h1, :]

    def readback(self):
        """The physical arrays as they are now (copied from the GPU)."""
        if self.device == "cpu":
            return self.phys
        return [t.cpu().numpy() for t in self.memory]

    def upload(self):
        """Copies `phys` to the GPU tensors (after `put` into `phys`)."""
        if self.device != "cpu":
            import torch  # noqa: PLC0415

            for t, p in zip(self.memory, self.phys, strict=True):
                t.copy_(torch.from_numpy(p))


def logical_cache(case, num_tokens, seed):
    """Random bytes of the whole logical cache: [layer][component, token, head, byte]."""
    heads, layers, head_dim, pre, _ = CASES[case]
    comps = 1 if pre[0] == "mla" else 2
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (layers, comps, num_tokens, heads, head_dim * 2), dtype=np.uint8)


def request(case, seed):
    """(num_tokens, prefill table, decode table): shuffled distinct blocks, the tokens a
    few short of the smaller cache."""
    _, _, _, pre, dec = CASES[case]
    rng = np.random.default_rng(seed)
    n = min(pre[3] * pre[4], dec[3] * dec[4]) - 3
    pt = rng.permutation(pre[3])[: -(-n // pre[4])]
    dt = rng.permutation(dec[3])[: -(-n // dec[4])]
    return n, [int(x) for x in pt], [int(x) for x in dt]


def side_caches(case, side, device="cpu"):
    _, _, _, pre, dec = CASES[case]
    tp = (pre if side == "prefill" else dec)[2]
    return [RankCache(case, side, r, device) for r in range(tp)]


def layouts(case, side):
    return [c.cache().layout for c in side_caches(case, side)]


def expected_decode(rc, table, num_tokens, logical):
    """The physical arrays decode rank cache `rc` must hold after the request."""
    want = [np.zeros_like(p) for p in rc.phys]
    rc.put(want, table, num_tokens, logical)
    return want


def decode_matches(rc, table, num_tokens, logical):
    """None if every byte of the rank's cache is the request's slice (and the rest zero),
    else where it differs."""
    for layer, (got, want) in enumerate(zip(rc.readback(), expected_decode(rc, table, num_tokens, logical), strict=True)):
        g, w = got.view(np.uint8), want.view(np.uint8)
        if not np.array_equal(g, w):
            return f"layer {layer}: {int((g != w).sum())} bytes differ"
    return None
