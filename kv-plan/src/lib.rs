//! # kv-plan
//!
//! Pure planning for moving a request's KV cache from a prefill server's ranks into a
//! decode server's, when the two are shaped differently: other tensor-parallel degrees
//! (KV heads split, or replicated when there are fewer heads than ranks), MLA's latent
//! that every rank holds, NHD or HND blocks, K and V apart or fused, other block sizes,
//! a tensor per layer or one for all. No engine, no network: layouts and a request in,
//! strided runs out, and a checker that proves them.
//!
//! - [`KvLayout`] ([`layout`](mod@layout)): one rank's paged cache: geometry shared by
//!   every layer and component, and a [`TensorPlace`] (region, offset) per (layer,
//!   component). Constructors for vLLM's FlashAttention and FlashInfer caches (NHD and
//!   HND), SGLang's MHA pool and both engines' MLA caches; [`heads_for_rank`] gives a TP
//!   rank's KV heads.
//! - [`KvRequest`]: the tokens and each side's block table (shared, or one per rank).
//! - [`plan()`] → [`KvPlan`]: per (prefill rank, decode rank), [`StridedRun`]s relative
//!   to the tensors' starts; the same runs move every (layer, component), so planning a
//!   61-layer model costs one layer's work. [`KvPlan::stats`] counts runs, rows and bytes
//!   against what a per-block-per-head path would post.
//! - [`check()`]: written apart from the planner, proves that every decode byte of the
//!   request lands once, from the same (token, head, byte) of a prefill rank holding the
//!   head, and that nothing else of decode's cache is written.
//!
//! ## Executing a plan
//!
//! For each pair and each (layer, component), [`PairPlan::placed`] names prefill's
//! region and decode's region of that tensor and adds each side's
//! [`TensorPlace::offset`] to the runs: [`Placed::write_runs`] are prefill's WRITEs
//! (`src` local in prefill's region, `dst` remote in decode's), [`Placed::read_runs`]
//! decode's READs for a pull (`src` local in decode's region, `dst` remote in
//! prefill's), as `fabric_core`'s strided transfers take them.
//!
//! ```
//! use kv_plan::{KvLayout, KvModel, KvRequest, Regions, check, heads_for_rank, plan};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Llama-3-8B shapes: 32 layers, 8 KV heads of 128 BF16, blocks of 16 tokens.
//! let model = KvModel::new(32, 8, 128, 2);
//! let side = |tp: u32| -> Result<Vec<KvLayout>, kv_plan::KvError> {
//!     (0..tp)
//!         .map(|r| KvLayout::vllm_flash_attn(&model, heads_for_rank(8, tp, r)?, 64, 16, Regions::PerTensor))
//!         .collect()
//! };
//! let (prefill, decode) = (side(2)?, side(4)?);
//! // 40 tokens: prefill blocks 7, 8, 9; decode blocks 3, 1, 2.
//! let req = KvRequest::new(40, vec![7, 8, 9], vec![3, 1, 2]);
//! let p = plan(&prefill, &decode, &req)?;
//! check(&prefill, &decode, &req, &p)?;
//! // Decode rank 1 holds heads 2..4, the second half of prefill rank 0's: one run of
//! // token rows per block, decode's blocks 1 and 2 following each other merge.
//! let pair = p.pair(0, 1).unwrap();
//! assert_eq!(pair.runs.len(), 2);
//! let placed = pair.placed(&prefill[0], &decode[1], 5, 1)?; // layer 5's V
//! assert_eq!(placed.prefill_region, 5);
//! let first = placed.write_runs().next().unwrap();
//! assert_eq!((first.len, first.count, first.src_stride, first.dst_stride), (512, 16, 1024, 512));
//! # Ok(())
//! # }
//! ```
//!
//! Dependencies: `fabric-core` for [`StridedRun`], the run type its engine and transports
//! already execute (no conversion, one definition of a row's meaning); `serde` so that
//! layouts and requests travel between processes and from Python as data; `thiserror`
//! for the typed error enums, as elsewhere in the workspace. For tests: `proptest`
//! (random layouts and requests that shrink to a small failing case), `fastrand` (block
//! table permutations from a seed the case carries) and `serde_json` (a layout's
//! round trip).
#![warn(missing_docs)]

pub mod check;
pub mod error;
pub mod layout;
pub mod plan;
pub mod request;

pub use check::{Cell, CheckError, check};
pub use error::{KvError, Result, Side};
pub use fabric_core::plan::StridedRun;
pub use layout::{HeadOrder, KvLayout, KvModel, Regions, TensorPlace, heads_for_rank};
pub use plan::{KvPlan, PairPlan, PairStats, Placed, PlanStats, plan};
pub use request::KvRequest;
