//! `xfer.kv`: a request's KV cache moved between prefill and decode ranks of different
//! shapes ([`xfer::kv`]) from Python. `Model` and `Layout` describe a rank's paged cache
//! (the constructors of `kv_plan` for vLLM's and SGLang's caches), `Request` a request's
//! block tables, `Plan` its strided runs, `Rank` one rank's end over an `Agent` (its cache
//! registered through the agent's own path, so numpy arrays and torch CUDA tensors both
//! work), `Transfers` a request's transfers from one rank, and `Event` what `Rank.poll`
//! reports. Every blocking call runs with the GIL released, in slices that let Python
//! deliver signals; failures are the package's exception classes
//! ([`crate::errors::agent_error`]): a failed request's message names it.
//!
//! The layouts from engines' tensors, the vLLM-shaped worker and the SGLang-shaped
//! sender and receiver are Python, in `python/xfer/kv.py`.

use crate::args::{pages, seconds, wait_sliced};
use crate::engine::{Engine, Registration};
use crate::errors::{agent_error, invalid};
use fabric_core::Fence;
use fabric_core::metadata::{AgentInfo, RegionDescriptor};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use xfer::kv::{
    HeadOrder, KvEvent, KvLayout, KvModel, KvPlan, KvRank, KvRankInfo, KvRequest, NoteKind,
    Regions, Side, TensorPlace,
};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A KV error of `kv_plan` as the package's exception.
fn kv_error(e: xfer::kv::KvError) -> PyErr {
    agent_error(&xfer::Error::Kv(e))
}

/// "prefill" or "decode".
fn side_of(s: &str) -> PyResult<Side> {
    match s {
        "prefill" => Ok(Side::Prefill),
        "decode" => Ok(Side::Decode),
        _ => Err(invalid(format!(
            "side={s:?}: expected \"prefill\" or \"decode\""
        ))),
    }
}

fn side_name(s: Side) -> &'static str {
    match s {
        Side::Prefill => "prefill",
        Side::Decode => "decode",
    }
}

fn regions_of(s: &str) -> PyResult<Regions> {
    match s {
        "per_tensor" => Ok(Regions::PerTensor),
        "packed" => Ok(Regions::Packed),
        _ => Err(invalid(format!(
            "regions={s:?}: expected \"per_tensor\" (a region per tensor the engine \
             allocates, in allocation order) or \"packed\" (all of them back to back in \
             region 0)"
        ))),
    }
}

/// A request id: bytes, or a str (its UTF-8).
fn id_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let id = if let Ok(s) = obj.cast::<PyString>() {
        s.to_str()?.as_bytes().to_vec()
    } else if let Ok(b) = obj.cast::<PyBytes>() {
        b.as_bytes().to_vec()
    } else {
        return Err(invalid(
            "a request id is bytes or a str (its UTF-8 bytes are sent)",
        ));
    };
    if id.is_empty() || id.len() > xfer::kv::MAX_REQUEST_ID {
        return Err(invalid(format!(
            "a request id of {} bytes: give 1 to {} bytes",
            id.len(),
            xfer::kv::MAX_REQUEST_ID
        )));
    }
    Ok(id)
}

/// A head range from `(start, end)` or a Python `range`.
fn head_range(obj: &Bound<'_, PyAny>) -> PyResult<Range<u32>> {
    let wrong = || {
        invalid(
            "heads: give the rank's KV heads as (start, end) or range(start, end) \
             (heads_for_rank(kv_heads, tp_size, tp_rank) computes them)",
        )
    };
    if let Ok(r) = obj.cast::<pyo3::types::PyRange>() {
        use pyo3::types::PyRangeMethods;
        if r.step()? != 1 {
            return Err(wrong());
        }
        let (s, e) = (r.start()?, r.stop()?);
        return Ok(u32::try_from(s).map_err(|_| wrong())?..u32::try_from(e).map_err(|_| wrong())?);
    }
    let (s, e): (u32, u32) = obj.extract().map_err(|_| wrong())?;
    Ok(s..e)
}

/// Block ids from a sequence of ints or a 1-D int64 numpy array.
fn block_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    pages(obj, what)?
        .into_iter()
        .map(|b| u32::try_from(b).map_err(|_| invalid(format!("{what}: block {b} is past 2**32"))))
        .collect()
}

/// A side's block tables: one shared table (a sequence of ints) or one per rank (a
/// sequence of sequences).
fn tables(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Vec<u32>>> {
    if let Ok(one) = block_ids(obj, what) {
        return Ok(vec![one]);
    }
    let wrong = || {
        invalid(format!(
            "{what}: expected a block table (ints, or a 1-D int numpy array) shared by the \
             side's ranks, or a list of them, one per rank"
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| wrong())?;
    if items.is_empty() {
        return Err(wrong());
    }
    items
        .iter()
        .enumerate()
        .map(|(i, t)| block_ids(t, &format!("{what}[{i}]")))
        .collect()
}

/// What a model's KV cache holds per token: layers, KV heads (1 for an MLA latent), elements
/// per head and bytes per element. `Model.mla(num_layers, latent_dim, elem_size)` is an MLA
/// model (one latent of `latent_dim` elements per token and layer).
#[pyclass(module = "xfer.kv", name = "Model", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyModel {
    model: KvModel,
}

#[pymethods]
impl PyModel {
    #[new]
    fn new(num_layers: u32, kv_heads: u32, head_dim: u32, elem_size: u32) -> PyModel {
        PyModel {
            model: KvModel::new(num_layers, kv_heads, head_dim, elem_size),
        }
    }

    /// An MLA model: one latent vector of `latent_dim` elements per token and layer (576
    /// for DeepSeek-V3: kv_lora_rank + qk_rope_head_dim), held by every rank.
    #[staticmethod]
    fn mla(num_layers: u32, latent_dim: u32, elem_size: u32) -> PyModel {
        PyModel {
            model: KvModel::mla(num_layers, latent_dim, elem_size),
        }
    }

    /// Attention layers.
    #[getter]
    fn num_layers(&self) -> u32 {
        self.model.num_layers
    }

    /// KV heads of the whole model (1 for MLA).
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.model.kv_heads
    }

    /// Elements per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.model.head_dim
    }

    /// Bytes per element.
    #[getter]
    fn elem_size(&self) -> u32 {
        self.model.elem_size
    }

    fn __repr__(&self) -> String {
        let m = &self.model;
        format!(
            "xfer.kv.Model(num_layers={}, kv_heads={}, head_dim={}, elem_size={})",
            m.num_layers, m.kv_heads, m.head_dim, m.elem_size
        )
    }
}

/// One rank's paged KV cache: the geometry shared by every layer and component (K, V, or
/// an MLA latent) and where each (layer, component) tensor starts (`places`: a (region,
/// byte offset) per tensor, layer-major). The bytes of (block b, token t of the block,
/// local head h) of (layer l, component c) lie in region `places[l * components + c][0]`
/// at `offset + b * block_stride + t * token_stride + h * head_stride`.
///
/// Made by the constructors of vLLM's and SGLang's caches (or `xfer.kv.layout_from_vllm`
/// and friends from the tensors themselves), sent to other ranks as JSON (`to_json`,
/// `from_json`) or pickled.
#[pyclass(module = "xfer.kv", name = "Layout", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyLayout {
    pub(crate) layout: KvLayout,
}

fn layouts(list: &[PyRef<'_, PyLayout>]) -> Vec<KvLayout> {
    list.iter().map(|l| l.layout.clone()).collect()
}

#[pymethods]
impl PyLayout {
    /// vLLM's FlashAttention backend: per layer one tensor `(2, num_blocks, block_size,
    /// heads, head_dim)` (NHD), K then V. heads: the rank's KV heads, (start, end).
    #[staticmethod]
    #[pyo3(signature = (model, heads, num_blocks, block_size, regions="per_tensor"))]
    fn vllm_flash_attn(
        model: &PyModel,
        heads: &Bound<'_, PyAny>,
        num_blocks: u32,
        block_size: u32,
        regions: &str,
    ) -> PyResult<PyLayout> {
        let l = KvLayout::vllm_flash_attn(
            &model.model,
            head_range(heads)?,
            num_blocks,
            block_size,
            regions_of(regions)?,
        )
        .map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// vLLM's FlashInfer (and other paged) backends: per layer one tensor `(num_blocks, 2,
    /// block_size, heads, head_dim)` in memory for order="NHD", `(num_blocks, 2, heads,
    /// block_size, head_dim)` for "HND".
    #[staticmethod]
    #[pyo3(signature = (model, heads, num_blocks, block_size, order="NHD", regions="per_tensor"))]
    fn vllm_flashinfer(
        model: &PyModel,
        heads: &Bound<'_, PyAny>,
        num_blocks: u32,
        block_size: u32,
        order: &str,
        regions: &str,
    ) -> PyResult<PyLayout> {
        let order = match order {
            "NHD" => HeadOrder::Nhd,
            "HND" => HeadOrder::Hnd,
            _ => {
                return Err(invalid(format!(
                    "order={order:?}: expected \"NHD\" or \"HND\""
                )));
            }
        };
        let l = KvLayout::vllm_flashinfer(
            &model.model,
            head_range(heads)?,
            num_blocks,
            block_size,
            order,
            regions_of(regions)?,
        )
        .map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// SGLang's MHA pool: per layer a K and a V buffer, each `(num_pages * page_size,
    /// heads, head_dim)` (num_pages counts every page, SGLang's padding page included);
    /// regions K0, V0, K1, V1, ... for "per_tensor".
    #[staticmethod]
    #[pyo3(signature = (model, heads, num_pages, page_size, regions="per_tensor"))]
    fn sglang_mha(
        model: &PyModel,
        heads: &Bound<'_, PyAny>,
        num_pages: u32,
        page_size: u32,
        regions: &str,
    ) -> PyResult<PyLayout> {
        let l = KvLayout::sglang_mha(
            &model.model,
            head_range(heads)?,
            num_pages,
            page_size,
            regions_of(regions)?,
        )
        .map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// vLLM's MLA cache: per layer `(num_blocks, block_size, latent)`, held by every rank
    /// (model from `Model.mla`).
    #[staticmethod]
    #[pyo3(signature = (model, num_blocks, block_size, regions="per_tensor"))]
    fn vllm_mla(
        model: &PyModel,
        num_blocks: u32,
        block_size: u32,
        regions: &str,
    ) -> PyResult<PyLayout> {
        let l = KvLayout::vllm_mla(&model.model, num_blocks, block_size, regions_of(regions)?)
            .map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// SGLang's MLA pool: per layer `(num_pages * page_size, 1, latent)`, held by every
    /// rank (model from `Model.mla`).
    #[staticmethod]
    #[pyo3(signature = (model, num_pages, page_size, regions="per_tensor"))]
    fn sglang_mla(
        model: &PyModel,
        num_pages: u32,
        page_size: u32,
        regions: &str,
    ) -> PyResult<PyLayout> {
        let l = KvLayout::sglang_mla(&model.model, num_pages, page_size, regions_of(regions)?)
            .map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// The same cache holding other KV heads (another rank of the same TP group): `heads`
    /// must count as many heads as this layout's.
    fn with_heads(&self, heads: &Bound<'_, PyAny>) -> PyResult<PyLayout> {
        let h = head_range(heads)?;
        if h.end.saturating_sub(h.start) != self.layout.local_heads() {
            return Err(invalid(format!(
                "heads {}..{}: this layout holds {} heads, and with_heads keeps the \
                 geometry (give as many)",
                h.start,
                h.end,
                self.layout.local_heads()
            )));
        }
        let mut l = self.layout.clone();
        l.heads = h;
        l.validate().map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// The same geometry with other tensor places: a (region, offset) per (layer,
    /// component), layer-major (say where an engine's tensors lie in its allocations).
    fn with_places(&self, places: Vec<(u32, u64)>) -> PyResult<PyLayout> {
        let places = places
            .into_iter()
            .map(|(region, offset)| TensorPlace { region, offset })
            .collect();
        let l = self.layout.clone().with_places(places).map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    /// Checks the layout (counts, strides that never alias, tensors apart); raises
    /// InvalidArgument naming what is wrong.
    fn validate(&self) -> PyResult<()> {
        self.layout.validate().map_err(kv_error)
    }

    /// The bytes each region must have at least (by region index): where its last
    /// tensor ends.
    fn region_sizes(&self) -> PyResult<Vec<u64>> {
        let l = &self.layout;
        let mut lens: Vec<u64> = Vec::new();
        for layer in 0..l.num_layers {
            for c in 0..l.components {
                let r = l.place(layer, c).map_err(kv_error)?.region as usize;
                if lens.len() <= r {
                    lens.resize(r + 1, 0);
                }
                lens[r] = lens[r].max(l.extent(layer, c).map_err(kv_error)?);
            }
        }
        Ok(lens)
    }

    /// The layout as JSON (the library's serde form), to send to other ranks.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.layout).map_err(|e| invalid(e.to_string()))
    }

    /// A layout from `to_json`'s text, validated.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<PyLayout> {
        let l: KvLayout =
            serde_json::from_str(text).map_err(|e| invalid(format!("not a KV layout: {e}")))?;
        l.validate().map_err(kv_error)?;
        Ok(PyLayout { layout: l })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let from = slf.get_type().getattr("from_json")?;
        Ok((from, (slf.get().to_json()?,)))
    }

    /// Attention layers.
    #[getter]
    fn num_layers(&self) -> u32 {
        self.layout.num_layers
    }

    /// Tensors per layer: 2 (K and V), 1 for an MLA latent.
    #[getter]
    fn components(&self) -> u32 {
        self.layout.components
    }

    /// Blocks (pages) of the cache.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.layout.num_blocks
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> u32 {
        self.layout.block_size
    }

    /// Bytes per element.
    #[getter]
    fn elem_size(&self) -> u32 {
        self.layout.elem_size
    }

    /// Elements per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.layout.head_dim
    }

    /// Bytes per head.
    #[getter]
    fn head_bytes(&self) -> u64 {
        self.layout.head_bytes
    }

    /// KV heads of the whole model.
    #[getter]
    fn total_heads(&self) -> u32 {
        self.layout.total_heads
    }

    /// The model's KV heads this rank holds: (start, end).
    #[getter]
    fn heads(&self) -> (u32, u32) {
        (self.layout.heads.start, self.layout.heads.end)
    }

    /// Bytes from one block to the next.
    #[getter]
    fn block_stride(&self) -> u64 {
        self.layout.block_stride
    }

    /// Bytes from one token to the next within a block.
    #[getter]
    fn token_stride(&self) -> u64 {
        self.layout.token_stride
    }

    /// Bytes from one local head to the next.
    #[getter]
    fn head_stride(&self) -> u64 {
        self.layout.head_stride
    }

    /// (region, offset) of each (layer, component) tensor, layer-major.
    #[getter]
    fn places(&self) -> Vec<(u32, u64)> {
        self.layout
            .places
            .iter()
            .map(|p| (p.region, p.offset))
            .collect()
    }

    fn __repr__(&self) -> String {
        let l = &self.layout;
        format!(
            "xfer.kv.Layout({} layers x {} components, {} blocks of {} tokens, heads {}..{} of \
             {}, {} bytes per head, strides block {} token {} head {})",
            l.num_layers,
            l.components,
            l.num_blocks,
            l.block_size,
            l.heads.start,
            l.heads.end,
            l.total_heads,
            l.head_bytes,
            l.block_stride,
            l.token_stride,
            l.head_stride
        )
    }
}

/// The KV heads rank `rank` of a tensor-parallel group of `tp` holds of the model's
/// `kv_heads`, as (start, end): a contiguous `kv_heads / tp` when tp <= kv_heads, else
/// one head replicated on `tp / kv_heads` consecutive ranks (as vLLM and SGLang split them).
#[pyfunction]
fn heads_for_rank(kv_heads: u32, tp: u32, rank: u32) -> PyResult<(u32, u32)> {
    let r = xfer::kv::heads_for_rank(kv_heads, tp, rank).map_err(kv_error)?;
    Ok((r.start, r.end))
}

/// A request to move: its tokens (from token 0) and each side's block tables, one shared
/// by the side's ranks (a list of ints, or a 1-D int numpy array) or one per rank (a list
/// of them). Token t lies in block `table[t // block_size]` of each rank's own table.
#[pyclass(module = "xfer.kv", name = "Request", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyRequest {
    request: KvRequest,
}

#[pymethods]
impl PyRequest {
    #[new]
    fn new(
        num_tokens: u64,
        prefill_blocks: &Bound<'_, PyAny>,
        decode_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<PyRequest> {
        Ok(PyRequest {
            request: KvRequest::per_rank(
                num_tokens,
                tables(prefill_blocks, "prefill_blocks")?,
                tables(decode_blocks, "decode_blocks")?,
            ),
        })
    }

    /// Tokens to move.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.request.num_tokens
    }

    /// Prefill's block tables (one shared, or one per rank).
    #[getter]
    fn prefill_blocks(&self) -> Vec<Vec<u32>> {
        self.request.prefill_blocks.clone()
    }

    /// Decode's block tables (one shared, or one per rank).
    #[getter]
    fn decode_blocks(&self) -> Vec<Vec<u32>> {
        self.request.decode_blocks.clone()
    }

    /// The request as JSON.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.request).map_err(|e| invalid(e.to_string()))
    }

    /// A request from `to_json`'s text.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<PyRequest> {
        let r: KvRequest =
            serde_json::from_str(text).map_err(|e| invalid(format!("not a KV request: {e}")))?;
        Ok(PyRequest { request: r })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let from = slf.get_type().getattr("from_json")?;
        Ok((from, (slf.get().to_json()?,)))
    }

    fn __repr__(&self) -> String {
        let r = &self.request;
        format!(
            "xfer.kv.Request({} tokens, {} prefill table(s), {} decode table(s))",
            r.num_tokens,
            r.prefill_blocks.len(),
            r.decode_blocks.len()
        )
    }
}

/// A request's plan: per (prefill rank, decode rank) pair, the strided runs that move one
/// (layer, component) tensor's share, the same for every layer. From `Rank.plan` or
/// `xfer.kv.plan(prefill, decode, request)`; deterministic, so every rank plans alike.
#[pyclass(module = "xfer.kv", name = "Plan", frozen)]
pub struct PyPlan {
    plan: Arc<KvPlan>,
}

#[pymethods]
impl PyPlan {
    /// Its size as a dict: per (layer, component) "runs", "rows" and "bytes" of all
    /// pairs; for the whole request "transfers" (strided runs x layers x components),
    /// "request_bytes", and "per_block_head" (what a path with one transfer per block and
    /// head would post); "pairs": a dict per pair (prefill, decode, runs, rows, bytes,
    /// block_heads).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.plan.stats();
        let d = PyDict::new(py);
        d.set_item("runs", s.runs)?;
        d.set_item("rows", s.rows)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("transfers", s.transfers)?;
        d.set_item("request_bytes", s.request_bytes)?;
        d.set_item("per_block_head", s.per_block_head)?;
        let pairs = PyList::empty(py);
        for p in &s.pairs {
            let pd = PyDict::new(py);
            pd.set_item("prefill", p.prefill)?;
            pd.set_item("decode", p.decode)?;
            pd.set_item("runs", p.runs)?;
            pd.set_item("rows", p.rows)?;
            pd.set_item("bytes", p.bytes)?;
            pd.set_item("block_heads", p.block_heads)?;
            pairs.append(pd)?;
        }
        d.set_item("pairs", pairs)?;
        Ok(d)
    }

    /// The (prefill rank, decode rank) pairs that move bytes.
    #[getter]
    fn pairs(&self) -> Vec<(u32, u32)> {
        self.plan
            .pairs
            .iter()
            .map(|p| (p.prefill, p.decode))
            .collect()
    }

    /// Layers the runs apply to.
    #[getter]
    fn num_layers(&self) -> u32 {
        self.plan.num_layers
    }

    /// Whether prefill rank `rank` sends anything of the request (a replica not chosen
    /// sends nothing, and hears of no reads).
    fn sends(&self, rank: u32) -> bool {
        self.plan.pairs_from(rank).next().is_some()
    }

    /// Whether decode rank `rank` receives anything of the request.
    fn receives(&self, rank: u32) -> bool {
        self.plan.pairs_to(rank).next().is_some()
    }

    fn __repr__(&self) -> String {
        let s = self.plan.stats();
        format!(
            "xfer.kv.Plan({} pairs, {} runs per tensor, {} transfers, {} bytes)",
            self.plan.pairs.len(),
            s.runs,
            s.transfers,
            s.request_bytes
        )
    }
}

/// Plans `request` from the prefill ranks' layouts (rank i at position i) into the decode
/// ranks' (GIL released).
#[pyfunction]
fn plan(
    py: Python<'_>,
    prefill: Vec<PyRef<'_, PyLayout>>,
    decode: Vec<PyRef<'_, PyLayout>>,
    request: &PyRequest,
) -> PyResult<PyPlan> {
    let (p, d) = (layouts(&prefill), layouts(&decode));
    let r = &request.request;
    let plan = py.detach(|| xfer::kv::plan(&p, &d, r)).map_err(kv_error)?;
    Ok(PyPlan {
        plan: Arc::new(plan),
    })
}

/// Proves `plan` by other means than the planner's: every decode byte of the request lands
/// once, from the same (token, head, byte) of a prefill rank holding the head, and nothing
/// else is written; raises InvalidArgument naming the first byte that does not.
#[pyfunction]
fn check(
    py: Python<'_>,
    prefill: Vec<PyRef<'_, PyLayout>>,
    decode: Vec<PyRef<'_, PyLayout>>,
    request: &PyRequest,
    plan: &PyPlan,
) -> PyResult<()> {
    let (p, d) = (layouts(&prefill), layouts(&decode));
    let (r, pl) = (&request.request, &plan.plan);
    py.detach(|| xfer::kv::check(&p, &d, r, pl))
        .map_err(|e| invalid(format!("the plan is wrong: {e}")))
}

/// What `Rank.poll` reports: `kind` ("landed": pushed into this decode rank; "read": read
/// from this prefill rank by all its readers), `request` (bytes) and `layer` (the layer
/// now whole, or None when the whole request is).
#[pyclass(module = "xfer.kv", name = "Event", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyEvent {
    kind: NoteKind,
    request: Vec<u8>,
    layer: Option<u32>,
}

#[pymethods]
impl PyEvent {
    /// "landed" or "read".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.kind {
            NoteKind::Landed => "landed",
            NoteKind::Read => "read",
        }
    }

    /// The request's id.
    #[getter]
    fn request<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.request)
    }

    /// The layer that is whole, or None for the whole request.
    #[getter]
    fn layer(&self) -> Option<u32> {
        self.layer
    }

    fn __repr__(&self) -> String {
        format!(
            "xfer.kv.Event({:?}, request={:?}, layer={})",
            self.kind(),
            String::from_utf8_lossy(&self.request),
            self.layer.map_or("None".into(), |l| l.to_string())
        )
    }
}

impl From<KvEvent> for PyEvent {
    fn from(e: KvEvent) -> PyEvent {
        match e {
            KvEvent::Layer {
                kind,
                request,
                layer,
            } => PyEvent {
                kind,
                request,
                layer: Some(layer),
            },
            KvEvent::Request { kind, request } => PyEvent {
                kind,
                request,
                layer: None,
            },
            // KvEvent is not non_exhaustive today; a future kind is reported as a request.
        }
    }
}

/// A request's transfers from one rank (`Rank.push`, `push_layer`, `pull`, `pull_layer`):
/// `wait`, `done`, `cancel`. Until they have finished, the request's blocks belong to the
/// agent (prefill's are read, decode's written).
#[pyclass(module = "xfer.kv", name = "Transfers", frozen)]
pub struct PyTransfers {
    id: Vec<u8>,
    /// `None` once `extend` gave them to another.
    transfers: Mutex<Option<xfer::kv::KvTransfers>>,
}

impl PyTransfers {
    fn new(t: xfer::kv::KvTransfers) -> PyTransfers {
        PyTransfers {
            id: t.id().to_vec(),
            transfers: Mutex::new(Some(t)),
        }
    }

    /// `f` on the transfers (`None` when given away).
    fn with<R>(&self, f: impl FnOnce(Option<&xfer::kv::KvTransfers>) -> R) -> R {
        f(lock(&self.transfers).as_ref())
    }
}

#[pymethods]
impl PyTransfers {
    /// Blocks (GIL released) until every transfer has finished, at most `timeout` seconds
    /// (None: no limit; Ctrl-C still interrupts). A failure is raised only once every
    /// transfer has finished (so no transport touches the request's memory any more), as
    /// the class of its cause (PeerUnreachable, PeerRemoved, ...) with a message naming the
    /// request, the layer and the peer rank. TimedOut ends only the wait.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let limit = seconds(timeout, "timeout")?;
        let done = wait_sliced(py, limit, |slice| {
            self.with(|t| match t {
                None => Some(Ok(())),
                Some(t) => match t.wait(slice) {
                    Ok(()) => Some(Ok(())),
                    Err(e) if t.is_finished() => Some(Err(e)),
                    Err(_) => None,
                },
            })
        })?;
        match done {
            Some(r) => r.map_err(|e| agent_error(&e)),
            // The last look: the error of a transfer not finished (TimedOut, named).
            None => py
                .detach(|| self.with(|t| t.map_or(Ok(()), |t| t.wait(Duration::ZERO))))
                .map_err(|e| agent_error(&e)),
        }
    }

    /// Whether every transfer has finished (either way); never blocks.
    fn done(&self) -> bool {
        self.with(|t| t.is_none_or(|t| t.is_finished()))
    }

    /// Cancels every transfer not finished (wait then says how each ended).
    fn cancel(&self) {
        self.with(|t| {
            if let Some(t) = t {
                t.cancel();
            }
        });
    }

    /// Takes `other`'s transfers into these (another layer of the same request); `other`
    /// is left empty.
    fn extend(&self, other: &PyTransfers) -> PyResult<()> {
        if std::ptr::eq(self, other) {
            return Err(invalid("extend: a Transfers cannot take its own transfers"));
        }
        if other.id != self.id {
            return Err(invalid(format!(
                "extend: transfers of request {:?} into those of {:?}",
                String::from_utf8_lossy(&other.id),
                String::from_utf8_lossy(&self.id)
            )));
        }
        let Some(taken) = lock(&other.transfers).take() else {
            return Ok(());
        };
        let mut mine = lock(&self.transfers);
        match mine.as_mut() {
            Some(m) => m.extend(taken),
            None => *mine = Some(taken),
        }
        Ok(())
    }

    /// The request's id.
    #[getter]
    fn request<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.id)
    }

    /// How many strided transfers (one per peer rank, layer and region pair).
    fn __len__(&self) -> usize {
        self.with(|t| t.map_or(0, |t| t.len()))
    }

    fn __repr__(&self) -> String {
        let (n, done) =
            self.with(|t| (t.map_or(0, |t| t.len()), t.is_none_or(|t| t.is_finished())));
        format!(
            "xfer.kv.Transfers(request={:?}, {n} transfers, {})",
            String::from_utf8_lossy(&self.id),
            if done { "done" } else { "pending" }
        )
    }
}

/// The info of a rank (what the other side attaches it with) from its parts, as bytes.
fn info_bytes(info: &KvRankInfo) -> PyResult<Vec<u8>> {
    serde_json::to_vec(info).map_err(|e| invalid(format!("the rank's info: {e}")))
}

fn parse_info(b: &[u8]) -> PyResult<KvRankInfo> {
    serde_json::from_slice(b).map_err(|e| invalid(format!("not a KV rank's info: {e}")))
}

/// The info bytes a rank of `side` with `layout` over `registrations` (by the layout's
/// region index, of `agent`) gives the other side, before its `Rank` exists (a rank that
/// learns the other side's layouts from their infos is made later, over the same
/// registrations).
#[pyfunction]
fn rank_info<'py>(
    py: Python<'py>,
    agent: &Engine,
    side: &str,
    rank: u32,
    layout: &PyLayout,
    registrations: Vec<Py<Registration>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let side = side_of(side)?;
    let mut regions: Vec<RegionDescriptor> = Vec::with_capacity(registrations.len());
    for r in &registrations {
        agent.check_registration(py, r.get())?;
        regions.push(r.get().region().descriptor().clone());
    }
    let agent: AgentInfo = agent.agent_handle()?.info().clone();
    let info = KvRankInfo {
        side,
        rank,
        agent,
        layout: layout.layout.clone(),
        regions,
    };
    Ok(PyBytes::new(py, &info_bytes(&info)?))
}

/// (side, rank, Layout) of a rank's info bytes.
#[pyfunction]
fn read_info(info: &[u8]) -> PyResult<(&'static str, u32, PyLayout)> {
    let i = parse_info(info)?;
    i.layout.validate().map_err(kv_error)?;
    Ok((side_name(i.side), i.rank, PyLayout { layout: i.layout }))
}

/// One rank's end of KV transfers over an Agent.
///
/// agent: its Agent; side: "prefill" or "decode"; rank: its rank on that side; memory:
/// the objects holding its cache by the layout's region index (numpy arrays, torch tensors
/// on the agent's GPU: each registered here through `Agent.register`, readable by peers
/// on a prefill rank, writable on a decode rank), or Regions of this agent made so;
/// prefill, decode: every rank's Layout of both sides (rank i at position i).
///
/// Attach the other side's ranks (`attach(their info)`), plan a request (`plan`), then on
/// prefill `push_layer` as each layer is saved (after the stream's work) or `push`, and on
/// decode `wait`/`wait_layer`/`poll` for what landed; or pull: decode `pull`/`pull_layer`,
/// prefill `wait`/`poll` to learn that every reader is done. Pushes, pulls and waits raise
/// RegionInvalidated if a registered torch tensor's storage was resized since it was
/// registered (see Agent.register).
#[pyclass(module = "xfer.kv", name = "Rank", frozen)]
pub struct PyRank {
    rank: Arc<KvRank>,
    /// The registrations, kept open while the rank lives.
    registrations: Vec<Py<Registration>>,
    /// The registered objects (for stream order) and their CUDA device.
    objs: Vec<(Py<PyAny>, Option<u32>)>,
}

impl PyRank {
    /// The fence of a push of `layer` (None: every layer): after the work queued on
    /// `stream`, or the current stream of the layer's tensor, for GPU memory.
    fn fence(
        &self,
        py: Python<'_>,
        layer: Option<u32>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Arc<dyn Fence>>> {
        let given = stream.filter(|s| !s.is_none());
        let cuda = match layer {
            Some(l) => {
                let region = self.rank.layout().place(l, 0).map_err(kv_error)?.region;
                self.objs.get(region as usize).filter(|(_, d)| d.is_some())
            }
            None => self.objs.iter().find(|(_, d)| d.is_some()),
        };
        match cuda {
            Some((obj, Some(device))) => Ok(Some(crate::stream::fence_for(
                obj.bind(py),
                given,
                *device,
            )?)),
            _ if given.is_some() => Err(invalid(
                "stream= orders pushes of GPU memory after a CUDA stream's work, and this \
                 rank's cache is host memory: leave stream out",
            )),
            _ => Ok(None),
        }
    }

    fn transfers(t: xfer::kv::KvTransfers) -> PyTransfers {
        PyTransfers::new(t)
    }

    /// Waits (GIL released, sliced) for request `id` (or its layer) to be whole here.
    fn wait_for(
        &self,
        py: Python<'_>,
        id: &[u8],
        layer: Option<u32>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let limit = seconds(timeout, "timeout")?;
        let rank = &self.rank;
        let step = |slice: Duration| {
            let slice = slice.max(Duration::from_millis(1));
            let r = match layer {
                Some(l) => rank.wait_layer(id, l, slice),
                None => rank.wait(id, slice),
            };
            match r {
                Ok(()) => Some(Ok(())),
                Err(xfer::Error::KvNotLanded { .. }) => None,
                Err(e) => Some(Err(e)),
            }
        };
        match wait_sliced(py, limit, step)? {
            Some(r) => r.map_err(|e| agent_error(&e)),
            None => {
                let last = py.detach(|| match layer {
                    Some(l) => rank.wait_layer(id, l, Duration::ZERO),
                    None => rank.wait(id, Duration::ZERO),
                });
                match last {
                    Ok(()) => Ok(()),
                    Err(xfer::Error::KvNotLanded {
                        request,
                        layer,
                        whole,
                        layers,
                        ..
                    }) => Err(agent_error(&xfer::Error::KvNotLanded {
                        request,
                        layer,
                        whole,
                        layers,
                        waited: limit.unwrap_or_default(),
                    })),
                    Err(e) => Err(agent_error(&e)),
                }
            }
        }
    }
}

#[pymethods]
impl PyRank {
    #[new]
    fn new(
        py: Python<'_>,
        agent: Py<Engine>,
        side: &str,
        rank: u32,
        memory: Vec<Bound<'_, PyAny>>,
        prefill: Vec<PyRef<'_, PyLayout>>,
        decode: Vec<PyRef<'_, PyLayout>>,
    ) -> PyResult<PyRank> {
        let side = side_of(side)?;
        let e = agent.get();
        let mut registrations = Vec::with_capacity(memory.len());
        for obj in &memory {
            let reg = if let Ok(r) = obj.cast::<Registration>() {
                e.check_registration(py, r.get())?;
                r.clone().unbind()
            } else {
                let (remote_write, remote_read) = match side {
                    Side::Prefill => (false, true),
                    Side::Decode => (true, false),
                };
                Py::new(py, e.register(py, obj, remote_write, remote_read)?)?
            };
            registrations.push(reg);
        }
        let regions: Vec<xfer::Region> = registrations
            .iter()
            .map(|r| r.get().region().clone())
            .collect();
        let objs = registrations
            .iter()
            .map(|r| {
                let r = r.get();
                let o = r.object(py).unwrap_or_else(|| py.None());
                (o, r.cuda_device())
            })
            .collect();
        let agent = e.agent_handle()?;
        let (p, d) = (layouts(&prefill), layouts(&decode));
        let kv = py
            .detach(|| KvRank::new(agent, side, rank, regions, p, d))
            .map_err(|e| agent_error(&e))?;
        Ok(PyRank {
            rank: Arc::new(kv),
            registrations,
            objs,
        })
    }

    /// What the other side's ranks attach this one with (bytes: its agent's info, its
    /// layout and its regions' descriptors).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &info_bytes(&self.rank.info())?))
    }

    /// Connects to a rank of the other side by its `info()` bytes (its layout must be the
    /// one this rank was given for it); attaching again replaces the connection.
    fn attach(&self, py: Python<'_>, info: &[u8]) -> PyResult<()> {
        let i = parse_info(info)?;
        let rank = &self.rank;
        py.detach(|| rank.attach(&i)).map_err(|e| agent_error(&e))
    }

    /// Plans `request` between every prefill and every decode rank (GIL released).
    fn plan(&self, py: Python<'_>, request: &PyRequest) -> PyResult<PyPlan> {
        let (rank, r) = (&self.rank, &request.request);
        let p = py.detach(|| rank.plan(r)).map_err(|e| agent_error(&e))?;
        Ok(PyPlan { plan: Arc::new(p) })
    }

    /// Prefill: writes layer `layer` of request `request_id` (bytes or str) into every
    /// decode rank the plan sends this rank's share to: one strided transfer per (decode
    /// rank, region pair), each telling its decode rank once its bytes are placed. GPU
    /// memory: the transfers start after the work queued so far on `stream` (default:
    /// torch's current stream for a torch tensor, as Agent.write), so call it right after
    /// launching the layer's kernels. Returns its Transfers.
    #[pyo3(signature = (request_id, plan, layer, stream=None))]
    fn push_layer(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        plan: &PyPlan,
        layer: u32,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTransfers> {
        let id = id_of(request_id)?;
        if layer >= self.rank.layers() {
            return Err(agent_error(&xfer::Error::KvNoSuchLayer {
                layer,
                layers: self.rank.layers(),
            }));
        }
        Registration::check_storages(py, &self.registrations, "this push is refused")?;
        let fence = self.fence(py, Some(layer), stream)?;
        let (rank, p) = (&self.rank, &plan.plan);
        let t = py
            .detach(|| rank.push_layer(&id, p, layer, fence))
            .map_err(|e| agent_error(&e))?;
        Ok(Self::transfers(t))
    }

    /// Prefill: every layer of request `request_id` (see push_layer).
    #[pyo3(signature = (request_id, plan, stream=None))]
    fn push(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        plan: &PyPlan,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTransfers> {
        let id = id_of(request_id)?;
        Registration::check_storages(py, &self.registrations, "this push is refused")?;
        let fence = self.fence(py, None, stream)?;
        let (rank, p) = (&self.rank, &plan.plan);
        let t = py
            .detach(|| rank.push(&id, p, fence))
            .map_err(|e| agent_error(&e))?;
        Ok(Self::transfers(t))
    }

    /// Decode: reads layer `layer` of request `request_id` from the prefill ranks the plan
    /// takes this rank's share from; each read tells its prefill rank once its bytes are
    /// here. Returns its Transfers (done once the bytes landed).
    fn pull_layer(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        plan: &PyPlan,
        layer: u32,
    ) -> PyResult<PyTransfers> {
        let id = id_of(request_id)?;
        Registration::check_storages(py, &self.registrations, "this pull is refused")?;
        let (rank, p) = (&self.rank, &plan.plan);
        let t = py
            .detach(|| rank.pull_layer(&id, p, layer))
            .map_err(|e| agent_error(&e))?;
        Ok(Self::transfers(t))
    }

    /// Decode: every layer of request `request_id` (see pull_layer).
    fn pull(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        plan: &PyPlan,
    ) -> PyResult<PyTransfers> {
        let id = id_of(request_id)?;
        Registration::check_storages(py, &self.registrations, "this pull is refused")?;
        let (rank, p) = (&self.rank, &plan.plan);
        let t = py
            .detach(|| rank.pull(&id, p))
            .map_err(|e| agent_error(&e))?;
        Ok(Self::transfers(t))
    }

    /// Blocks (GIL released) until every layer of request `request_id` is whole here
    /// (pushed into this decode rank; on a prefill rank: read by every reader), at most
    /// `timeout` seconds (None: no limit); raises TimedOut naming the request and the
    /// layers whole.
    #[pyo3(signature = (request_id, timeout=None))]
    fn wait(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let id = id_of(request_id)?;
        Registration::check_storages(py, &self.registrations, "this wait is refused")?;
        self.wait_for(py, &id, None, timeout)
    }

    /// Blocks until layer `layer` of request `request_id` is whole here (see wait).
    #[pyo3(signature = (request_id, layer, timeout=None))]
    fn wait_layer(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        layer: u32,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let id = id_of(request_id)?;
        if layer >= self.rank.layers() {
            return Err(agent_error(&xfer::Error::KvNoSuchLayer {
                layer,
                layers: self.rank.layers(),
            }));
        }
        Registration::check_storages(py, &self.registrations, "this wait is refused")?;
        self.wait_for(py, &id, Some(layer), timeout)
    }

    /// What became whole here since the last call: a list of Event (a layer, then the
    /// request); never blocks.
    fn poll(&self, py: Python<'_>) -> PyResult<Vec<PyEvent>> {
        let rank = &self.rank;
        let events = py.detach(|| rank.poll()).map_err(|e| agent_error(&e))?;
        Ok(events.into_iter().map(PyEvent::from).collect())
    }

    /// Forgets what was heard of request `request_id` (once done with it).
    fn forget(&self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_of(request_id)?;
        self.rank.forget(&id);
        Ok(())
    }

    /// Notifications of the agent that were not KV notes, taken meanwhile (a list of
    /// xfer.Notification).
    fn other_notifications(&self) -> Vec<crate::engine::Notification> {
        self.rank
            .other_notifications()
            .into_iter()
            .map(crate::engine::Notification::from)
            .collect()
    }

    /// "prefill" or "decode".
    #[getter]
    fn side(&self) -> &'static str {
        side_name(self.rank.info().side)
    }

    /// Its rank on its side.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank.info().rank
    }

    /// Its Layout.
    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout {
            layout: self.rank.layout().clone(),
        }
    }

    /// Layers of the model.
    #[getter]
    fn layers(&self) -> u32 {
        self.rank.layers()
    }

    /// The registrations of its cache, by region index.
    #[getter]
    fn registrations(&self, py: Python<'_>) -> Vec<Py<Registration>> {
        self.registrations.iter().map(|r| r.clone_ref(py)).collect()
    }

    fn __repr__(&self) -> String {
        let i = self.rank.info();
        format!(
            "xfer.kv.Rank({} rank {}, {} layers, heads {}..{})",
            side_name(i.side),
            i.rank,
            self.rank.layers(),
            i.layout.heads.start,
            i.layout.heads.end
        )
    }
}

/// The `kv` submodule of `_xfer`, re-exported as `xfer.kv`.
pub fn module<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyModule>> {
    let m = PyModule::new(py, "kv")?;
    m.add_class::<PyModel>()?;
    m.add_class::<PyLayout>()?;
    m.add_class::<PyRequest>()?;
    m.add_class::<PyPlan>()?;
    m.add_class::<PyEvent>()?;
    m.add_class::<PyTransfers>()?;
    m.add_class::<PyRank>()?;
    m.add_function(wrap_pyfunction!(heads_for_rank, &m)?)?;
    m.add_function(wrap_pyfunction!(plan, &m)?)?;
    m.add_function(wrap_pyfunction!(check, &m)?)?;
    m.add_function(wrap_pyfunction!(rank_info, &m)?)?;
    m.add_function(wrap_pyfunction!(read_info, &m)?)?;
    Ok(m)
}
