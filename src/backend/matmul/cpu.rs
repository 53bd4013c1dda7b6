//! The CPU reference of the matmul: packed operands, a 6×16 register tile
//! (6×32 with AVX-512), k-blocks that carry the running sums in C (so every
//! output still adds `p = 0, 1, ..., k-1` in order), threads over row panels
//! or batches.

use super::{Causal, Halves, MatmulDims, MatmulOps};
use crate::backend::pack::widen_bits;
use crate::backend::cpu::simd::{self, Level};
use crate::backend::cpu::pool;
use crate::backend::cpu::{assume_init_mut, cpu_threads, new_vec, CpuStorage, Elem};
use crate::backend::round::{self, Format};
use crate::Result;
use std::cell::RefCell;
use std::mem::MaybeUninit;

impl MatmulOps for CpuStorage {
    fn matmul(&self, rhs: &CpuStorage, d: MatmulDims, halves: Halves, round: Option<Format>) -> Result<CpuStorage> {
        if d.tokens.any() {
            return super::over_head_major(self, rhs, d, halves, round, None);
        }
        Ok(self.product(rhs, d, halves, round, None))
    }
    fn matmul_add(
        &self,
        rhs: &CpuStorage,
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        addend: &CpuStorage,
    ) -> Result<CpuStorage> {
        if d.tokens.any() {
            return super::over_head_major(self, rhs, d, halves, round, Some(addend));
        }
        Ok(self.product(rhs, d, halves, round, Some(addend)))
    }
}

impl CpuStorage {

    fn product(
        &self,
        rhs: &CpuStorage,
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        addend: Option<&CpuStorage>,
    ) -> CpuStorage {
        match (self, rhs, addend) {
            (CpuStorage::F32(a), CpuStorage::F32(b), e) => {
                let (a, b) = (a.get(), b.get());
                let e = e.map(|e| e.f32s());
                let e = e.as_deref().map(Vec::as_slice);
                f32::wrap(matmul_f32(Src::of(&a, halves.a), Src::of(&b, halves.b), d, round, e))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b), e) if halves == Halves::default() => {
                let mut c = matmul_f64(&a.get(), &b.get(), d, round);
                if let Some(e) = e {
                    for (c, &e) in c.iter_mut().zip(f64::view(e).iter()) {
                        // e first, as the elementwise sum takes its operands
                        #[allow(clippy::assign_op_pattern)]
                        {
                            *c = e + *c;
                        }
                    }
                }
                f64::wrap(c)
            }
            _ => unreachable!("dtypes checked by the dispatch; 16-bit storage is f32 words"),
        }
    }
}

/// An operand as the packing reads it: float32 values, or 16-bit patterns
/// (value `e` in word `e / 2`, as [`pack`](crate::backend::pack) stores them)
/// widened exactly as they are read — the values `unpack` would give, without
/// writing them out.
#[derive(Clone, Copy)]
enum Src<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Fp16(&'a [u16]),
}

impl<'a> Src<'a> {
    /// The operand held in `buf`: its values, or its words when `half`.
    fn of(buf: &'a [f32], half: Option<Format>) -> Src<'a> {
        match half {
            None => Src::F32(buf),
            Some(Format::Bf16) => Src::Bf16(halves_of(buf)),
            Some(Format::Fp16) => Src::Fp16(halves_of(buf)),
        }
    }
    /// The operand from value `off` on.
    fn from(self, off: usize) -> Src<'a> {
        match self {
            Src::F32(v) => Src::F32(&v[off..]),
            Src::Bf16(h) => Src::Bf16(&h[off..]),
            Src::Fp16(h) => Src::Fp16(&h[off..]),
        }
    }
}

/// The 16-bit patterns of words whose low half holds the even value: on a
/// little-endian machine, the words' bytes read two at a time.
fn halves_of(words: &[f32]) -> &[u16] {
    const { assert!(cfg!(target_endian = "little"), "16-bit operands assume little-endian words") };
    // SAFETY: u16 has a smaller alignment than f32, and the slice covers
    // exactly the words' bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u16, words.len() * 2) }
}

/// Reading one kind of [`Src`]: value `i`, and `W` consecutive values.
trait Load: Copy {
    fn at(self, i: usize) -> f32;
    /// The values as [`copy_runs_avx2`] reads them, where it can.
    #[inline(always)]
    fn runs(&self) -> Option<Runs<'_>> {
        None
    }
    #[inline(always)]
    fn run<const W: usize>(self, i: usize) -> [f32; W] {
        std::array::from_fn(|l| self.at(i + l))
    }
    /// Panel row `p` of `panel` (rows of `W`) from the values at `rows[r] + p`,
    /// rounded to `round`.
    #[inline(always)]
    fn gather<const W: usize>(self, panel: &mut [f32], rows: [usize; W], round: Option<Format>) {
        for (p, dst) in panel.chunks_exact_mut(W).enumerate() {
            for r in 0..W {
                dst[r] = self.at(rows[r] + p);
            }
        }
        if let Some(f) = round {
            round::round_slice(panel, f);
        }
    }
}

impl Load for &[f32] {
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self[i]
    }
    #[inline(always)]
    fn runs(&self) -> Option<Runs<'_>> {
        Some(Runs::F32(self))
    }
    #[inline(always)]
    fn run<const W: usize>(self, i: usize) -> [f32; W] {
        self[i..i + W].try_into().unwrap()
    }
    #[inline(always)]
    fn gather<const W: usize>(self, panel: &mut [f32], offsets: [usize; W], mut round: Option<Format>) {
        // slices of the rows' stretches: their bounds checks leave the loop
        let len = panel.len() / W;
        let rows: [&[f32]; W] = offsets.map(|r| &self[r..r + len]);
        if vector_gather::<W>() {
            // the lanes' rows are evenly spaced: the next panel's start W rows on
            let ld = offsets[1] - offsets[0];
            let bf16 = round == Some(Format::Bf16);
            // SAFETY: `vector_gather` holds only where the CPU has AVX2.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                gather_f32_avx2::<W>(panel, &rows, W * ld, bf16)
            };
            round = round.filter(|_| !bf16);
        } else {
            for (p, dst) in panel.chunks_exact_mut(W).enumerate() {
                for r in 0..W {
                    dst[r] = rows[r][p];
                }
            }
        }
        if let Some(f) = round {
            round::round_slice(panel, f);
        }
    }
}

/// Whether panels of `W` lanes are gathered by [`transpose_rows`].
#[inline(always)]
fn vector_gather<const W: usize>() -> bool {
    cfg!(target_arch = "x86_64") && (W == MR || W.is_multiple_of(8)) && simd::level() >= Level::Avx2
}

/// [`Load::gather`] of float32 rows (the next panel's rows `next` values
/// further on), rounded to bf16 when `bf16`, for a panel of `W` = MR or
/// 8·j lanes: eight terms of every row loaded as one vector and transposed in
/// registers, instead of one scalar load and store per value (an A panel of
/// probabilities, `T × T` per head, otherwise took as long to pack as to
/// multiply).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gather_f32_avx2<const W: usize>(panel: &mut [f32], rows: &[&[f32]; W], next: usize, bf16: bool) {
    use std::arch::x86_64::*;
    let len = panel.len() / W;
    assert!(rows.iter().all(|r| r.len() >= len));
    // the next panel's rows, a cache line each per 16 terms: too short a
    // stretch of each row for the hardware prefetcher to catch
    let prefetch = |p: usize| {
        for row in rows {
            _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(next + p) as *const i8);
        }
    };
    let load = |r: usize, p: usize| {
        // SAFETY: transpose_rows loads terms p .. p + 8 only for p + 8 <= len,
        // and every row holds `len` values (asserted above).
        let a = unsafe { _mm256_loadu_ps(rows[r].as_ptr().add(p)) };
        if bf16 {
            round::bf16_lanes_avx2(a)
        } else {
            a
        }
    };
    let at = |r: usize, p: usize| {
        let v = rows[r][p];
        if bf16 {
            round::bf16_f32(v)
        } else {
            v
        }
    };
    // SAFETY: the CPU has AVX2 (this function's contract); `panel` holds
    // `len · W` values, and `load` reads inside the rows for p + 8 <= len.
    unsafe { transpose_rows::<W>(panel, len, prefetch, load, at) };
}

/// [`gather_f32_avx2`] of bf16 patterns, widened exactly (no rounding).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gather_bf16_avx2<const W: usize>(panel: &mut [f32], rows: &[&[u16]; W]) {
    use std::arch::x86_64::*;
    let len = panel.len() / W;
    assert!(rows.iter().all(|r| r.len() >= len));
    let load = |r: usize, p: usize| {
        // SAFETY: transpose_rows loads terms p .. p + 8 (16 bytes of halves)
        // only for p + 8 <= len, and every row holds `len` (asserted above).
        let h = unsafe { _mm_loadu_si128(rows[r].as_ptr().add(p) as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    };
    let at = |r: usize, p: usize| f32::from_bits((rows[r][p] as u32) << 16);
    // SAFETY: as in gather_f32_avx2.
    unsafe { transpose_rows::<W>(panel, len, |_| {}, load, at) };
}

/// `panel[p · W + r] = row r's term p` for `p < len`, from `load(r, p)` (the
/// row's terms `p .. p + 8`) and `at(r, p)` (one term, for the ragged end);
/// `prefetch(p)` every 16 terms.
/// `W` is MR (six rows: an 8 × 6 transpose) or a multiple of 8 (8 × 8
/// transposes: the B panels of either tile).
///
/// # Safety
/// The CPU has AVX2; `panel` holds `len · W` values and `load` reads inside
/// the rows for `p + 8 <= len`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose_rows<const W: usize>(
    panel: &mut [f32],
    len: usize,
    prefetch: impl Fn(usize),
    load: impl Fn(usize, usize) -> std::arch::x86_64::__m256,
    at: impl Fn(usize, usize) -> f32,
) {
    use std::arch::x86_64::*;
    const { assert!((W == MR && MR == 6) || W.is_multiple_of(8)) };
    assert!(panel.len() >= len * W);
    let out = panel.as_mut_ptr();
    let mut p = 0;
    while p + 8 <= len {
        if p % 16 == 0 {
            prefetch(p);
        }
        if W == MR {
            let (a0, a1, a2, a3, a4, a5) = (load(0, p), load(1, p), load(2, p), load(3, p), load(4, p), load(5, p));
            // per 128-bit half (terms 0..4 | 4..8): pairs of rows interleaved
            let (t0, t1) = (_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
            let (t2, t3) = (_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
            let (t4, t5) = (_mm256_unpacklo_ps(a4, a5), _mm256_unpackhi_ps(a4, a5));
            // rows 0..4 of term i (and of term 4 + i in the high half)
            let head = [
                _mm256_shuffle_ps::<0x44>(t0, t2),
                _mm256_shuffle_ps::<0xEE>(t0, t2),
                _mm256_shuffle_ps::<0x44>(t1, t3),
                _mm256_shuffle_ps::<0xEE>(t1, t3),
            ];
            // rows 4 and 5 of terms 0, 1 (t4) and 2, 3 (t5), low and high 64 bits
            let tail = [t4, t4, t5, t5];
            for (half, base) in [(0, p), (1, p + 4)] {
                for i in 0..4 {
                    let (h, t) = if half == 0 {
                        (_mm256_castps256_ps128(head[i]), _mm256_castps256_ps128(tail[i]))
                    } else {
                        (_mm256_extractf128_ps::<1>(head[i]), _mm256_extractf128_ps::<1>(tail[i]))
                    };
                    let t = _mm_castps_pd(t);
                    // SAFETY: term base + i < p + 8 <= len, so its MR = 6
                    // values (4 here, 2 after) lie inside the `len · W` of
                    // `panel` (asserted above).
                    unsafe {
                        let dst = out.add((base + i) * MR);
                        _mm_storeu_ps(dst, h);
                        if i % 2 == 0 {
                            _mm_store_sd(dst.add(4) as *mut f64, t);
                        } else {
                            _mm_storeh_pd(dst.add(4) as *mut f64, t);
                        }
                    }
                }
            }
        } else {
            for g in 0..W / 8 {
                let r = g * 8;
                let a = [
                    load(r, p),
                    load(r + 1, p),
                    load(r + 2, p),
                    load(r + 3, p),
                    load(r + 4, p),
                    load(r + 5, p),
                    load(r + 6, p),
                    load(r + 7, p),
                ];
                for (q, c) in simd::transpose8(a).into_iter().enumerate() {
                    // SAFETY: term p + q < len, and lanes g·8 .. g·8 + 8 of
                    // its W lie inside `panel` (asserted above).
                    unsafe { _mm256_storeu_ps(out.add((p + q) * W + g * 8), c) };
                }
            }
        }
        p += 8;
    }
    for p in p..len {
        for r in 0..W {
            // SAFETY: p < len and r < W: inside `panel` (asserted above).
            unsafe { *out.add(p * W + r) = at(r, p) };
        }
    }
}

/// The k-major packing of one source row into panels of `W` lanes (A's,
/// `W` = MR, or B's, `W` a multiple of 8): run `i` (`W` values of `row`) to
/// panel row `p` of panel `i` (panels `kc · W` apart in `panels`), rounded
/// to bf16 when `bf16` in registers.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_runs_avx2<const W: usize>(panels: &mut [f32], row: Runs, kc: usize, p: usize, bf16: bool) {
    use std::arch::x86_64::*;
    const { assert!(W == MR || W.is_multiple_of(8)) };
    let row = match row {
        Runs::F32(row) => row,
        Runs::Bf16(halves) => {
            assert!(W != MR && !bf16, "bf16 runs are widened into B's panels, not rounded");
            // SAFETY: the CPU has AVX2 (this function's contract).
            return unsafe { widen_runs_avx2::<W>(panels, halves, kc, p) };
        }
    };
    let runs = row.len() / W;
    assert!(runs == 0 || panels.len() >= ((runs - 1) * kc + p + 1) * W);
    for i in 0..runs {
        // SAFETY: run i < runs = row.len() / W lies inside `row`, and panel
        // row p of panel i inside `panels` (asserted above).
        let (src, dst) = unsafe { (row.as_ptr().add(i * W), panels.as_mut_ptr().add((i * kc + p) * W)) };
        if W == MR {
            // values 0..4 and 4..6 of the run (masked moves were slower)
            // SAFETY: as above.
            let (mut lo, mut hi) =
                unsafe { (_mm_loadu_ps(src), _mm_castpd_ps(_mm_load_sd(src.add(4) as *const f64))) };
            if bf16 {
                let v = round::bf16_lanes_avx2(_mm256_set_m128(hi, lo));
                (lo, hi) = (_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            }
            // SAFETY: as above.
            unsafe {
                _mm_storeu_ps(dst, lo);
                _mm_store_sd(dst.add(4) as *mut f64, _mm_castps_pd(hi));
            }
        } else {
            for g in (0..W).step_by(8) {
                // SAFETY: values g .. g + 8 of the run, inside both (as above).
                unsafe {
                    let v = _mm256_loadu_ps(src.add(g));
                    _mm256_storeu_ps(dst.add(g), if bf16 { round::bf16_lanes_avx2(v) } else { v });
                }
            }
        }
    }
}

/// [`copy_runs_avx2`] of bf16 patterns into panels of `W` lanes, a multiple
/// of 8: each widened exactly, eight at a time.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_runs_avx2<const W: usize>(panels: &mut [f32], row: &[u16], kc: usize, p: usize) {
    use std::arch::x86_64::*;
    let runs = row.len() / W;
    assert!(W.is_multiple_of(8) && (runs == 0 || panels.len() >= ((runs - 1) * kc + p + 1) * W));
    for i in 0..runs {
        for g in (0..W).step_by(8) {
            // SAFETY: values g .. g + 8 of run i < runs lie inside `row`, and
            // of panel row p of panel i inside `panels` (asserted above).
            unsafe {
                let h = _mm_loadu_si128(row.as_ptr().add(i * W + g) as *const __m128i);
                let v = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
                _mm256_storeu_ps(panels.as_mut_ptr().add((i * kc + p) * W + g), v);
            }
        }
    }
}

/// A source row's values as [`copy_runs_avx2`] reads them.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Runs<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl<'a> Runs<'a> {
    fn slice(self, from: usize, to: usize) -> Runs<'a> {
        match self {
            Runs::F32(v) => Runs::F32(&v[from..to]),
            Runs::Bf16(h) => Runs::Bf16(&h[from..to]),
        }
    }
}

/// bf16 patterns: the top half of the float32.
#[derive(Clone, Copy)]
struct Bf16s<'a>(&'a [u16]);

impl Load for Bf16s<'_> {
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        f32::from_bits((self.0[i] as u32) << 16)
    }
    #[inline(always)]
    fn runs(&self) -> Option<Runs<'_>> {
        Some(Runs::Bf16(self.0))
    }
    #[inline(always)]
    fn gather<const W: usize>(self, panel: &mut [f32], offsets: [usize; W], round: Option<Format>) {
        let len = panel.len() / W;
        let rows: [&[u16]; W] = offsets.map(|r| &self.0[r..r + len]);
        if vector_gather::<W>() {
            // SAFETY: `vector_gather` holds only where the CPU has AVX2.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                gather_bf16_avx2::<W>(panel, &rows)
            };
        } else {
            for (p, dst) in panel.chunks_exact_mut(W).enumerate() {
                for r in 0..W {
                    dst[r] = f32::from_bits((rows[r][p] as u32) << 16);
                }
            }
        }
        if let Some(f) = round {
            round::round_slice(panel, f);
        }
    }
    #[inline(always)]
    fn run<const W: usize>(self, i: usize) -> [f32; W] {
        let h: &[u16; W] = self.0[i..i + W].try_into().unwrap();
        h.map(|h| f32::from_bits((h as u32) << 16))
    }
}

/// fp16 patterns, widened by the contract's integer steps.
#[derive(Clone, Copy)]
struct Fp16s<'a>(&'a [u16]);

impl Load for Fp16s<'_> {
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        f32::from_bits(widen_bits(self.0[i] as u32, Format::Fp16))
    }
}

/// Rows of the register tile.
const MR: usize = 6;

thread_local! {
    /// Packed operands of this thread's last matmul, reused so that a training
    /// step's hundreds of products do not each map (and page-fault) fresh memory.
    static PACKED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The k-range `[kb, kb + kc)` of `lanes` lanes of one operand of one
/// batch, packed into panels of `W` lanes — A into row panels (`W` = MR), B
/// into column panels (`W` = NR): `buf[panel][p][lane]` (panel stride
/// `kc * W`; `buf` holds exactly the panels), lanes past `lanes` zero;
/// each value rounded once when `round` is set, right after it is written
/// (a separate pass read a block of A back from memory; the zero padding
/// stays zero). One k-block at a time, so the packed block is still in cache
/// when the tiles read it.
///
/// Panel `pi` is packed only over its terms `[lo, hi) = terms(pi)` of the
/// block (block-local; the tiles read no others): a causal product's row
/// panels sum only the terms up to (or from) their rows. Both ends are
/// non-decreasing in `pi`, as a causal product's are.
///
/// `k_major`: the source's rows (stride `ld`) run across the lanes, one row
/// per p (Aᵀ, B); otherwise each lane is a row (stride `ld`) along k (A, Bᵀ).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pack<const W: usize, S: Load>(
    buf: &mut [f32],
    src: S,
    lanes: usize,
    ld: usize,
    (kb, kc): (usize, usize),
    k_major: bool,
    round: Option<Format>,
    terms: impl Fn(usize) -> (usize, usize),
) {
    let panels = lanes.div_ceil(W);
    debug_assert_eq!(buf.len(), panels * kc * W);
    if k_major {
        // Row p holds the p-th value of every panel, and the block's rows are
        // one contiguous stretch of the source: walk it in order (a sequential
        // read the prefetcher keeps ahead of), scattering each row over the
        // panels with fixed-size copies (vector moves, not memcpy calls).
        // Panel by panel instead strided through the source once per panel:
        // 0.93x of ndarray on the weight gradient 320x4096x904, now ~1.05x.
        // The panels that sum term p are `from..to`: `terms` is monotone,
        // so both ends only move forward as p does.
        #[cfg(target_arch = "x86_64")]
        let runs = match src.runs() {
            Some(Runs::F32(v)) if vector_gather::<W>() && round != Some(Format::Fp16) => Some(Runs::F32(v)),
            Some(Runs::Bf16(h)) if vector_gather::<W>() && W != MR && round.is_none() => Some(Runs::Bf16(h)),
            _ => None,
        };
        let (mut from, mut to) = (0, 0);
        for p in 0..kc {
            while from < panels && terms(from).1 <= p {
                from += 1;
            }
            while to < panels && terms(to).0 <= p {
                to += 1;
            }
            let row = (kb + p) * ld;
            // a float32 or bf16 source's whole panels in vector registers; the rest below
            #[cfg(target_arch = "x86_64")]
            let from = match runs {
                Some(v) => {
                    let whole = to.min(lanes / W).max(from);
                    let dst = &mut buf[from * kc * W..];
                    // SAFETY: `vector_gather` holds only where the CPU has AVX2.
                    unsafe { copy_runs_avx2::<W>(dst, v.slice(row + from * W, row + whole * W), kc, p, round.is_some()) };
                    whole
                }
                None => from,
            };
            for pi in from..to {
                let l0 = pi * W;
                let dst: &mut [f32; W] = (&mut buf[(pi * kc + p) * W..][..W]).try_into().unwrap();
                if l0 + W <= lanes {
                    *dst = src.run::<W>(row + l0);
                } else {
                    for (l, d) in dst.iter_mut().enumerate() {
                        *d = if l0 + l < lanes { src.at(row + l0 + l) } else { 0.0 };
                    }
                }
                if let Some(f) = round {
                    round::round_slice(dst, f);
                }
            }
        }
    } else {
        for (pi, panel) in buf.chunks_exact_mut(kc * W).enumerate() {
            let (lo, hi) = terms(pi);
            let l0 = pi * W;
            let real = W.min(lanes - l0);
            // Lane r's row starts its stretch [kb + lo, kb + hi) here.
            let row = |r: usize| (l0 + r) * ld + kb + lo;
            let panel = &mut panel[lo * W..hi * W];
            if real == W {
                // Gather the W rows' p-th values into one panel row, reading
                // W streams forward, writing one (vectorised as a transpose).
                src.gather::<W>(panel, std::array::from_fn(row), round);
            } else {
                panel.fill(0.0);
                for r in 0..real {
                    for (p, dst) in panel.chunks_exact_mut(W).enumerate() {
                        dst[r] = src.at(row(r) + p);
                    }
                }
                if let Some(f) = round {
                    round::round_slice(panel, f);
                }
            }
        }
    }
}

/// [`pack`] of all `lanes` lanes (`ld` and `terms` as there) into the reused `buf`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pack_all<'b, const W: usize>(
    buf: &'b mut Vec<f32>,
    src: Src,
    lanes: usize,
    ld: usize,
    kblock: (usize, usize),
    k_major: bool,
    round: Option<Format>,
    terms: impl Fn(usize) -> (usize, usize),
) -> &'b [f32] {
    let buf = cache_aligned(buf, lanes.div_ceil(W) * kblock.1 * W);
    // 16-bit patterns already are values of their format, rounded by `pack`
    // (which quiets NaNs): rounding them to it again would change no bit.
    let round = match (src, round) {
        (Src::Bf16(_), Some(Format::Bf16)) | (Src::Fp16(_), Some(Format::Fp16)) => None,
        _ => round,
    };
    match src {
        Src::F32(v) => pack::<W, _>(buf, v, lanes, ld, kblock, k_major, round, terms),
        Src::Bf16(h) => pack::<W, _>(buf, Bf16s(h), lanes, ld, kblock, k_major, round, terms),
        Src::Fp16(h) => pack::<W, _>(buf, Fp16s(h), lanes, ld, kblock, k_major, round, terms),
    }
    buf
}

/// `len` values of the reused `buf` starting on a 64-byte boundary, so that
/// no vector load of a packed panel row straddles two cache lines (the
/// allocator only promises 16 bytes). The buffer only grows (`resize` fills
/// the growth; a product's smaller operands use a prefix, so the next larger
/// one does not fill again); `pack` overwrites every value it uses.
fn cache_aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    const LINE: usize = 64 / std::mem::size_of::<f32>();
    if buf.len() < len + LINE - 1 {
        buf.resize(len + LINE - 1, 0.0);
    }
    let skip = buf.as_ptr().align_offset(64).min(LINE - 1);
    &mut buf[skip..skip + len]
}

/// Deepest k-block: an MR×KC slice of A (7.6 KiB) and a KC×NR slice of B
/// (20 KiB; 40 KiB for the AVX-512 tile) stay in a 48 KiB L1 while a tile
/// is computed. A multiple of MR, so the ragged terms of a causal tile
/// (positions `i0 .. i0 + MR`, `i0` a multiple of MR) never straddle two
/// k-blocks.
const KC: usize = 54 * MR;

/// The depth of a product's k-blocks (`k > 0`): `k` in as few blocks of at
/// most [`KC`] as it takes, evenly (a multiple of MR; the last block takes
/// the rest). A short last block would be a whole extra pass over C for a few
/// terms (k = 320 in one block, not 252 + 68; k = 512 in 258 + 254, not
/// 252 + 252 + 8).
fn block_depth(k: usize) -> usize {
    k.div_ceil(k.div_ceil(KC)).next_multiple_of(MR)
}

/// Row panels per L2 block of A (MC = 72 rows).
const MC_PANELS: usize = 12;

/// One MR×NR tile of C (row stride `ldc`) over one k-block:
/// `c[r][j] = fma(a[p][r], b[p][j], c[r][j])` for `p` ascending, starting from
/// +0 in the first k-block (`first`: C is not read, it may be uninitialised)
/// and from the running values in C after it; each sum rounded to `round`
/// as it is stored (the last k-block's). Carrying the sums in C from one
/// k-block to the next keeps every output's sum in the contract's exact order
/// while the blocks stay in cache.
///
/// # Safety
/// `ap` holds `kc * MR` values, `bp` `kc * NR`, and `c` is valid for writes of
/// `MR` rows of `NR` values at stride `ldc` (and for reads unless `first`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn micro_kernel<const NR: usize>(
    kernel: Level,
    ap: *const f32,
    bp: *const f32,
    kc: usize,
    c: *mut f32,
    ldc: usize,
    first: bool,
    ragged: Ragged,
    round: Option<Format>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        // bf16 rounding is a few integer steps on the registers; fp16's is
        // the rows' pass below
        let bf16 = round == Some(Format::Bf16);
        let vector = match kernel {
            Level::Avx2 if NR == 16 => {
                // SAFETY: a level is only chosen where the CPU has its
                // instructions (`simd::available`); the pointers are valid per
                // this fn's contract, and each kernel is only used with its
                // own width.
                unsafe { micro_kernel_avx2(ap, bp, kc, c, ldc, first, ragged, bf16) };
                true
            }
            Level::Avx512 if NR == 32 => {
                // SAFETY: as above.
                unsafe { micro_kernel_avx512(ap, bp, kc, c, ldc, first, ragged, bf16) };
                true
            }
            _ => false,
        };
        if vector {
            if let Some(f) = round.filter(|_| !bf16) {
                // SAFETY: the tile's rows at `c`, valid per this fn's contract.
                unsafe { round_rows::<NR>(c, ldc, f) };
            }
            return;
        }
    }
    let mut acc = [[0.0f32; NR]; MR];
    if !first {
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: row r of the tile, valid for reads unless `first`.
            unsafe { std::ptr::copy_nonoverlapping(c.add(r * ldc), row.as_mut_ptr(), NR) };
        }
    }
    for p in 0..kc {
        for (r, row) in acc.iter_mut().enumerate() {
            if !ragged.keeps(r, p, kc) {
                continue;
            }
            // SAFETY: p < kc and r < MR: inside the `kc · MR` values of `ap`.
            let a = unsafe { *ap.add(p * MR + r) };
            for (j, v) in row.iter_mut().enumerate() {
                // SAFETY: p < kc and j < NR: inside the `kc · NR` values of `bp`.
                *v = a.mul_add(unsafe { *bp.add(p * NR + j) }, *v);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        // SAFETY: row r of the tile, valid for writes.
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(r * ldc), NR) };
    }
    if let Some(f) = round {
        // SAFETY: the tile's rows at `c`, just written.
        unsafe { round_rows::<NR>(c, ldc, f) };
    }
}

/// Rounds the MR rows of `NR` values at `c` (row stride `ldc`) in place.
///
/// # Safety
/// `c` is valid for reads and writes of those rows.
#[inline(always)]
unsafe fn round_rows<const NR: usize>(c: *mut f32, ldc: usize, f: Format) {
    for r in 0..MR {
        // SAFETY: row r's `NR` values, valid for reads and writes (the
        // caller's promise), and no other reference to them is in use.
        round::round_slice(unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) }, f);
    }
}

/// The same tile in vector registers: two accumulators of `$w` lanes per row
/// (12 in all), `$fmadd` being a fused multiply-add exactly like
/// `f32::mul_add`. One body, instantiated for AVX2 (`$w` = 8) and AVX-512
/// (`$w` = 16); the tile is `2 * $w` columns wide.
macro_rules! vector_kernel {
    ($(#[$m:meta])* $name:ident, $feat:literal, $v:ty, $w:literal,
     $zero:ident, $load:ident, $store:ident, $set1:ident, $fmadd:ident, $bf16:path) => {
        $(#[$m])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            ap: *const f32,
            bp: *const f32,
            kc: usize,
            c: *mut f32,
            ldc: usize,
            first: bool,
            ragged: Ragged,
            bf16: bool,
        ) {
            use std::arch::x86_64::*;
            const NR: usize = 2 * $w;
            let mut acc: [[$v; 2]; MR] = [[$zero(); 2]; MR];
            if !first {
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: row r's NR = 2·$w values, valid for reads
                    // unless `first` (the caller's promise).
                    unsafe {
                        row[0] = $load(c.add(r * ldc));
                        row[1] = $load(c.add(r * ldc + $w));
                    }
                }
            }
            // The next tile down (the caller's next call) starts by loading its C rows,
            // strided, from L2/L3: ask for them now, while this tile computes. A
            // prefetch never faults, so an address past C is harmless.
            for r in MR..2 * MR {
                _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(c.wrapping_add(r * ldc + NR - 1) as *const i8);
            }
            // One k-step: B's row p against the 6 rows' values of A at p, for
            // the rows `keep` admits (constant masks: the tests fold away).
            let step = |acc: &mut [[$v; 2]; MR], p: usize, keep: [bool; MR]| {
                // SAFETY: p < kc: row p of B's panel, inside its `kc · NR` values.
                let (b0, b1) = unsafe { ($load(bp.add(p * NR)), $load(bp.add(p * NR + $w))) };
                for (r, row) in acc.iter_mut().enumerate() {
                    if keep[r] {
                        // SAFETY: p < kc and r < MR: inside A's `kc · MR` values.
                        let a = $set1(unsafe { *ap.add(p * MR + r) });
                        row[0] = $fmadd(a, b0, row[0]);
                        row[1] = $fmadd(a, b1, row[1]);
                    }
                }
            };
            // A ragged head or tail of at most MR terms is summed by the rows that
            // keep each term; its loops have constant bounds, so they unroll, the
            // row tests fold away and the accumulators stay in registers.
            let (lo, hi) = ragged.full_terms(kc);
            if let Ragged::Head(len) = ragged {
                for q in 0..MR {
                    if q < len {
                        step(&mut acc, q, std::array::from_fn(|r| r <= q));
                    }
                }
            }
            let mut p = lo;
            while p + 4 <= hi {
                step(&mut acc, p, [true; MR]);
                step(&mut acc, p + 1, [true; MR]);
                step(&mut acc, p + 2, [true; MR]);
                step(&mut acc, p + 3, [true; MR]);
                p += 4;
            }
            for p in p..hi {
                step(&mut acc, p, [true; MR]);
            }
            if let Ragged::Tail(len) = ragged {
                for q in 0..MR {
                    if q < len {
                        step(&mut acc, hi + q, std::array::from_fn(|r| r >= q));
                    }
                }
            }
            if bf16 {
                for row in acc.iter_mut() {
                    *row = [$bf16(row[0]), $bf16(row[1])];
                }
            }
            for (r, row) in acc.iter().enumerate() {
                // SAFETY: row r's NR values, valid for writes (the caller's promise).
                unsafe {
                    $store(c.add(r * ldc), row[0]);
                    $store(c.add(r * ldc + $w), row[1]);
                }
            }
        }
    };
}

vector_kernel!(
    /// The AVX2 tile: 6 × 16.
    micro_kernel_avx2, "avx2,fma", __m256, 8,
    _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps, round::bf16_lanes_avx2
);
vector_kernel!(
    /// The AVX-512 tile: 6 × 32.
    micro_kernel_avx512, "avx512f,avx2,fma", __m512, 16,
    _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps, round::bf16_lanes_avx512
);

/// The terms of one tile on the diagonal of a [`Causal`] product that only
/// some of its rows sum: local row `r` of the tile is position `i0 + r`, and
/// the tile's ragged terms are positions `i0 ..`, so ragged term `q` is kept
/// by rows `r ≥ q` (`Tail`: terms up to the row) or `r ≤ q` (`Head`: terms
/// from the row). The count is below MR only where the matrix ends.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ragged {
    None,
    /// The first `len` terms of the kernel's `kc` are ragged.
    Head(usize),
    /// The last `len` terms are ragged.
    Tail(usize),
}

impl Ragged {
    /// The terms `[lo, hi)` of `kc` that every row sums.
    #[inline(always)]
    fn full_terms(self, kc: usize) -> (usize, usize) {
        match self {
            Ragged::None => (0, kc),
            Ragged::Head(len) => (len, kc),
            Ragged::Tail(len) => (0, kc - len),
        }
    }
    /// Whether local row `r` sums term `p` of `kc`.
    #[inline(always)]
    fn keeps(self, r: usize, p: usize, kc: usize) -> bool {
        match self {
            Ragged::None => true,
            Ragged::Head(len) => p >= len || r <= p,
            Ragged::Tail(len) => p < kc - len || r >= p - (kc - len),
        }
    }
}

/// What a [`tile`] call computes over its k-range: the first starts every
/// sum from +0; the last (`round` set when the product is rounded) rounds the
/// finished sums as the kernel stores them, instead of a separate pass
/// over C; `ragged` terms are summed only by the rows that keep them.
#[derive(Clone, Copy)]
struct KBlock {
    first: bool,
    round: Option<Format>,
    ragged: Ragged,
    kernel: Level,
}

/// One tile of C at `c` (row stride `ldc`), of which `rows` × `cols` are real:
/// full tiles run the kernel on C itself, edge tiles on a padded copy.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile<const NR: usize>(
    ap: &[f32],
    bp: &[f32],
    kc: usize,
    c: &mut [MaybeUninit<f32>],
    ldc: usize,
    rows: usize,
    cols: usize,
    blk: KBlock,
) {
    assert!(ap.len() >= kc * MR && bp.len() >= kc * NR);
    assert!(c.len() >= (rows - 1) * ldc + cols);
    let cp = c.as_mut_ptr() as *mut f32;
    if rows == MR && cols == NR {
        // SAFETY: lengths checked above; C is read only after the first k-block wrote it.
        unsafe {
            micro_kernel::<NR>(blk.kernel, ap.as_ptr(), bp.as_ptr(), kc, cp, ldc, blk.first, blk.ragged, blk.round)
        };
        return;
    }
    let mut t = [[0.0f32; NR]; MR];
    if !blk.first {
        for (r, row) in t.iter_mut().enumerate().take(rows) {
            // SAFETY: inside `c` (checked above) and written by an earlier k-block.
            unsafe { std::ptr::copy_nonoverlapping(cp.add(r * ldc), row.as_mut_ptr(), cols) };
        }
    }
    let tp = t.as_mut_ptr() as *mut f32;
    // SAFETY: `t` is exactly one MR×NR tile; lengths of ap/bp checked above.
    unsafe { micro_kernel::<NR>(blk.kernel, ap.as_ptr(), bp.as_ptr(), kc, tp, NR, blk.first, blk.ragged, blk.round) };
    for (r, row) in t.iter().enumerate().take(rows) {
        // SAFETY: inside `c` (checked above).
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), cp.add(r * ldc), cols) };
    }
}

/// One k-block of a product: terms `[kb, kb + kc)` of `k`.
#[derive(Clone, Copy)]
struct Block {
    kb: usize,
    kc: usize,
    k: usize,
    round: Option<Format>,
    causal: Causal,
    kernel: Level,
}

impl Block {
    /// For the tile of rows `[i0, i0 + MR)`: the terms `[lo, hi)` of this
    /// block it sums, and how; `None` when it sums none here.
    #[inline(always)]
    fn tile_terms(&self, i0: usize) -> Option<(usize, usize, KBlock)> {
        let (tlo, thi) = self.causal.terms(i0, i0 + MR, self.k);
        let (lo, hi) = (tlo.max(self.kb), thi.min(self.kb + self.kc));
        if lo >= hi {
            return None;
        }
        // Block starts and i0 are multiples of MR: the ragged terms [i0, i0 + MR) ∩ [0, k)
        // lie wholly inside the block that holds i0.
        let ragged = match self.causal {
            Causal::TermsUpToRow if i0 >= lo && i0 < hi => Ragged::Tail(hi - i0),
            Causal::TermsFromRow if i0 == lo => Ragged::Head((i0 + MR).min(hi) - i0),
            _ => Ragged::None,
        };
        let last = hi == thi;
        Some((
            lo,
            hi,
            KBlock {
                first: lo == tlo,
                round: if last { self.round } else { None },
                ragged,
                kernel: self.kernel,
            },
        ))
    }
}

/// Writes +0 to columns `[from(r), cols)` of each of the `rows` rows of a
/// tile of C (row stride `ldc`).
#[inline(always)]
fn zero_from(
    c: &mut [MaybeUninit<f32>],
    ldc: usize,
    rows: usize,
    cols: usize,
    from: impl Fn(usize) -> usize,
) {
    for r in 0..rows {
        let j = from(r).min(cols);
        c[r * ldc + j..r * ldc + cols].fill(MaybeUninit::new(0.0));
    }
}

/// One k-block of rows `[r0, r0 + rows)` of one batch's `C`, in `out`
/// (exactly those rows; uninitialised before each tile's first terms, which
/// start its sums from +0 and write them), from the block's packed operands
/// (panel strides `kc * MR` and `kc * NR`; A's panels are those rows').
/// `r0` is a multiple of MR.
#[inline(always)]
fn matmul_block<const NR: usize>(
    ap: &[f32],
    bp: &[f32],
    n: usize,
    r0: usize,
    out: &mut [MaybeUninit<f32>],
    blk: Block,
    addend: Option<&[f32]>,
) {
    // the addend goes onto each tile's final values, on the last k-block
    let addend = addend.filter(|_| blk.kb + blk.kc >= blk.k);
    assert!(addend.is_none() || blk.causal == Causal::No, "an addend with a causal mask");
    let rows = out.len() / n;
    let row_panels = rows.div_ceil(MR);
    let col_panels = n.div_ceil(NR);
    let kc = blk.kc;
    // Row panels in groups of MC_PANELS: that slice of A (about 72 KiB)
    // stays in L2 while every column panel of B streams past it.
    for ib in (0..row_panels).step_by(MC_PANELS) {
        for pj in 0..col_panels {
            let (j0, cols) = (pj * NR, NR.min(n - pj * NR));
            for pi in ib..(ib + MC_PANELS).min(row_panels) {
                let (i0, tile_rows) = (r0 + pi * MR, MR.min(rows - pi * MR));
                let c = &mut out[pi * MR * n + j0..];
                let above = blk.causal == Causal::Outputs && j0 > i0 + tile_rows - 1;
                let Some((lo, hi, kblk)) = blk.tile_terms(i0).filter(|_| !above) else {
                    // No terms in this block: a tile with none at all (wholly
                    // above the diagonal, or no rows keeping a term) is +0.
                    let (tlo, thi) = blk.causal.terms(i0, i0 + MR, blk.k);
                    if blk.kb == 0 && (above || tlo >= thi) {
                        zero_from(c, n, tile_rows, cols, |_| 0);
                    }
                    continue;
                };
                let a_blk = &ap[(pi * kc + lo - blk.kb) * MR..];
                let b_blk = &bp[(pj * kc + lo - blk.kb) * NR..];
                tile::<NR>(a_blk, b_blk, hi - lo, c, n, tile_rows, cols, kblk);
                if blk.causal == Causal::Outputs && hi == blk.k && j0 + cols - 1 > i0 {
                    // row i0 + r keeps the columns j0 + j <= i0 + r
                    zero_from(c, n, tile_rows, cols, |r| (i0 + r + 1).saturating_sub(j0));
                }
                if let Some(e) = addend {
                    add_tile(c, &e[pi * MR * n + j0..], n, tile_rows, cols);
                }
            }
        }
    }
}

simd::multiversion! {
    /// `c = e + c` over a tile of `rows × cols` values, rows `ldc` apart,
    /// its values written: an addend's sum with the product (`e` first, as
    /// the elementwise sum takes its operands).
    fn add_tile(c: &mut [MaybeUninit<f32>], e: &[f32], ldc: usize, rows: usize, cols: usize) {
        for r in 0..rows {
            let (cr, er) = (&mut c[r * ldc..r * ldc + cols], &e[r * ldc..r * ldc + cols]);
            for (c, &e) in cr.iter_mut().zip(er) {
                // SAFETY: the tile's k-blocks wrote it.
                let v = unsafe { c.assume_init() };
                c.write(e + v);
            }
        }
    }
}

/// Products below this many multiply-adds run on one thread: handing out the
/// parts would cost a noticeable share of so little work.
const THREADED_MACS: usize = 1 << 21;

/// `f` as the writer of a part of a product: `f(batch entry, first row, out)`
/// hands `out` back written (the bound names the lifetime that a closure's
/// own signature cannot).
#[inline(always)]
fn part_writer<F: for<'c> Fn(usize, usize, &'c mut [MaybeUninit<f32>]) -> &'c mut [f32]>(f: F) -> F {
    f
}

/// The product on the CPU's widest tile.
fn matmul_f32(a: Src, b: Src, d: MatmulDims, round: Option<Format>, addend: Option<&[f32]>) -> Vec<f32> {
    matmul_f32_on(simd::level(), a, b, d, round, cpu_threads(), Around { ld: [None; 2], addend })
}

/// [`matmul_f32`] on the calling thread alone, for a caller that runs one
/// product per thread itself (attention, head by head). `a` and `b` are
/// float32 values or, with a format, the words of 16-bit copies; `ld` their
/// row strides in values where their rows are not packed side by side (a
/// head's rows among all heads' in `(B, T, H, D)`).
pub(crate) fn matmul_f32_one_thread(
    (a, ha): (&[f32], Option<Format>),
    (b, hb): (&[f32], Option<Format>),
    d: MatmulDims,
    round: Option<Format>,
    ld: [Option<usize>; 2],
) -> Vec<f32> {
    matmul_f32_on(simd::level(), Src::of(a, ha), Src::of(b, hb), d, round, 1, Around { ld, addend: None })
}

/// How a product's operands and output lie beyond its dims.
#[derive(Clone, Copy)]
struct Around<'a> {
    /// The operands' row strides, where not their rows' lengths.
    ld: [Option<usize>; 2],
    /// `(batch, m, n)` values added to the outputs (see [`add_tile`]).
    addend: Option<&'a [f32]>,
}

/// The product on the tile of level `kernel` (one the CPU has): 6 × 16 in the
/// portable loop and with AVX2, 6 × 32 with AVX-512. Each output is the same
/// chain of fused multiply-adds whichever tile computes it; only the tile's
/// width, and so that of B's packed panels, differs.
/// Products from [`THREADED_MACS`] run on up to `threads` threads.
fn matmul_f32_on(
    kernel: Level,
    a: Src,
    b: Src,
    d: MatmulDims,
    round: Option<Format>,
    threads: usize,
    around: Around,
) -> Vec<f32> {
    match kernel {
        Level::Avx512 => product::<32>(kernel, a, b, d, round, threads, around),
        _ => product::<16>(kernel, a, b, d, round, threads, around),
    }
}

simd::multiversion! {
    /// [`matmul_f32_on`] with B's panels and the tile `NR` columns wide.
    fn product<const NR: usize>(
        kernel: Level,
        a: Src,
        b: Src,
        d: MatmulDims,
        round: Option<Format>,
        threads: usize,
        around: Around,
    ) -> Vec<f32> {
        let Around { ld, addend } = around;
        let MatmulDims { batch, m, k, n, .. } = d;
        let len = batch * m * n;
        assert!(addend.is_none_or(|e| e.len() == len), "an addend of another size");
        if len == 0 || k == 0 {
            // empty sums are +0
            return addend.map_or_else(|| vec![0.0f32; len], |e| e.iter().map(|&e| e + 0.0).collect());
        }
        let threads = if batch * m * n * k >= THREADED_MACS { threads } else { 1 };
        // Rows `[r0, r0 + rows)` of one batch entry, k-block by k-block: pack
        // the block of both operands (rounding each element once), then every
        // tile of C over it — the running sums stay in C between blocks, in
        // the contract's order. No zero fill: every element is written by its
        // first k-block.
        let one = part_writer(|bi, r0, c| {
            let rows = c.len() / n;
            let e = addend.map(|e| &e[bi * m * n + r0 * n..][..c.len()]);
            let (a, b) = (a.from(bi * d.a_batch_stride), b.from(bi * d.b_batch_stride));
            // Aᵀ's rows run over m, A's over k; B's over n, Bᵀ's over k
            let lda = ld[0].unwrap_or(if d.trans_a { m } else { k });
            let ldb = ld[1].unwrap_or(if d.trans_b { k } else { n });
            let a = a.from(if d.trans_a { r0 } else { r0 * lda });
            // Taken out, not borrowed: a pool thread waiting on a fork may
            // meanwhile run another product's work.
            let (mut ap_buf, mut bp_buf) = PACKED.with_borrow_mut(std::mem::take);
            let (depth, mut kb) = (block_depth(k), 0);
            while kb < k {
                let kc = depth.min(k - kb);
                let blk = Block { kb, kc, k, round, causal: d.causal, kernel };
                // each row panel only over the terms its tiles sum
                let a_terms = |pi| blk.tile_terms(r0 + pi * MR).map_or((0, 0), |(lo, hi, _)| (lo - kb, hi - kb));
                let ap = pack_all::<MR>(&mut ap_buf, a, rows, lda, (kb, kc), d.trans_a, round, a_terms);
                let all = |_| (0, kc);
                let bp = pack_all::<NR>(&mut bp_buf, b, n, ldb, (kb, kc), !d.trans_b, round, all);
                matmul_block::<NR>(ap, bp, n, r0, c, blk, e);
                kb += depth;
            }
            PACKED.with_borrow_mut(|p| *p = (ap_buf, bp_buf));
            // SAFETY: every tile of these rows was written by the first
            // k-block that sums terms into it (which starts from +0 instead of
            // reading C), or, where no block sums any, set to +0 by
            // `zero_from` in the first block (`matmul_block`).
            unsafe { assume_init_mut(c) }
        });
        new_vec(len, |out, written| {
            if threads > 1 && batch >= threads {
                // Many small products (attention heads): split the batch.
                let per = batch.div_ceil(threads);
                let parts = pool::map(out.chunks_mut(per * m * n).enumerate(), |(t, chunk)| {
                    let entries = chunk.chunks_mut(m * n).enumerate();
                    entries.map(|(i, c)| one(t * per + i, 0, c)).collect::<Vec<_>>()
                });
                written.add_all(parts.into_iter().flatten());
            } else {
                // Whole row panels per thread, each thread the whole product over
                // its rows (its own packing of B: no wait between k-blocks).
                // Each output's k-loop is untouched, so results do not depend on
                // the thread count.
                let rows_per_thread = m.div_ceil(MR).div_ceil(threads) * MR;
                for (bi, c) in out.chunks_mut(m * n).enumerate() {
                    if threads == 1 {
                        written.add(one(bi, 0, c));
                    } else {
                        let panels = c.chunks_mut(rows_per_thread * n).enumerate();
                        written.add_all(pool::map(panels, |(t, chunk)| one(bi, t * rows_per_thread, chunk)));
                    }
                }
            }
        })
    }
}

fn matmul_f64(a: &[f64], b: &[f64], d: MatmulDims, round: Option<Format>) -> Vec<f64> {
    let MatmulDims { batch, m, k, n, .. } = d;
    let rd = |v: f64| match round {
        Some(f) => round::round_f64(v, f),
        None => v,
    };
    let mut out = vec![0.0f64; batch * m * n];
    for bi in 0..batch {
        let (ab, bb) = (&a[bi * d.a_batch_stride..], &b[bi * d.b_batch_stride..]);
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for p in (0..k).filter(|&p| d.causal.includes(i, j, p)) {
                    let x = if d.trans_a {
                        ab[p * m + i]
                    } else {
                        ab[i * k + p]
                    };
                    let y = if d.trans_b {
                        bb[j * k + p]
                    } else {
                        bb[p * n + j]
                    };
                    acc = rd(x).mul_add(rd(y), acc);
                }
                out[bi * m * n + i * n + j] = rd(acc);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contract's matmul written as plainly as possible.
    fn naive(a: &[f32], b: &[f32], d: MatmulDims, round: Option<Format>) -> Vec<f32> {
        let rd = |v: f32| round.map_or(v, |f| round::round_f32(v, f));
        let mut out = Vec::new();
        for bi in 0..d.batch {
            for i in 0..d.m {
                for j in 0..d.n {
                    let mut acc = 0.0f32;
                    for p in (0..d.k).filter(|&p| d.causal.includes(i, j, p)) {
                        let x = if d.trans_a {
                            a[bi * d.a_batch_stride + p * d.m + i]
                        } else {
                            a[bi * d.a_batch_stride + i * d.k + p]
                        };
                        let y = if d.trans_b {
                            b[bi * d.b_batch_stride + j * d.k + p]
                        } else {
                            b[bi * d.b_batch_stride + p * d.n + j]
                        };
                        acc = rd(x).mul_add(rd(y), acc);
                    }
                    out.push(rd(acc));
                }
            }
        }
        out
    }

    /// A linear congruential generator's top 31 bits, from `seed`.
    fn lcg(mut seed: u64) -> impl FnMut() -> u32 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        }
    }

    /// `batch` contiguous products `op(A): (m, k)` by `op(B): (k, n)`.
    fn dims(batch: usize, (m, k, n): (usize, usize, usize), (ta, tb): (bool, bool), causal: Causal) -> MatmulDims {
        MatmulDims {
            batch,
            m,
            k,
            n,
            trans_a: ta,
            trans_b: tb,
            a_batch_stride: m * k,
            b_batch_stride: k * n,
            causal,
            tokens: Default::default(),
        }
    }

    /// Every kernel this CPU has gives the plain loop's bits (a NaN for a NaN).
    fn every_kernel_is_the_plain_loop(a: &[f32], b: &[f32], d: MatmulDims, round: Option<Format>) {
        let want = naive(a, b, d, round);
        let same = |x: &f32, y: &f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
        for kernel in simd::available() {
            let got = matmul_f32_on(kernel, Src::F32(a), Src::F32(b), d, round, cpu_threads(), Around { ld: [None; 2], addend: None });
            assert!(got.iter().zip(&want).all(|(x, y)| same(x, y)), "{kernel:?} {d:?} {round:?}");
        }
    }

    #[test]
    fn blocked_threaded_matmul_equals_the_plain_loop_bitwise() {
        let mut next = lcg(1);
        const { assert!(200 * 600 * 600 >= THREADED_MACS && 4 * 120 * 400 * 400 >= THREADED_MACS) };
        for &(batch, m, k, n) in &[
            (1, 1, 1, 1),
            (2, 7, 3, 5),
            (1, 13, 300, 17),
            (3, 6, 16, 16),
            // one whole AVX-512 tile, two, and one column short of one
            (3, 6, 16, 32),
            (2, 12, 40, 64),
            (1, 7, 5, 31),
            (1, 70, 600, 33),
            // past the threading threshold (THREADED_MACS multiply-adds):
            // rows split over threads, more than one MC block of rows and more
            // than one k-block; then a batch split
            (1, 200, 600, 600),
            (4, 120, 400, 400),
            (1, 0, 4, 3),
            (1, 4, 0, 3),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for round in [None, Some(Format::Bf16), Some(Format::Fp16)] {
                    let bstride = if next().is_multiple_of(2) { 0 } else { k * n };
                    let a: Vec<f32> = (0..batch * m * k)
                        .map(|_| (next() as f32 / 4e9) - 0.5)
                        .collect();
                    let b: Vec<f32> = (0..(if bstride == 0 { 1 } else { batch }) * k * n)
                        .map(|_| (next() as f32 / 4e9) - 0.5)
                        .collect();
                    let d = MatmulDims { b_batch_stride: bstride, ..dims(batch, (m, k, n), (ta, tb), Causal::No) };
                    every_kernel_is_the_plain_loop(&a, &b, d, round);
                }
            }
        }
    }

    /// Threaded products started from several threads at once: each runs
    /// on a pool thread, and a pool thread waiting on one product's fork may
    /// run another's work meanwhile — each must still get its own bits (and
    /// no packing buffer may be borrowed twice).
    #[test]
    fn concurrent_threaded_products_keep_their_bits() {
        let (m, k, n) = (96, 1200, 600);
        const { assert!(96 * 1200 * 600 >= THREADED_MACS) };
        let d = MatmulDims {
            batch: 1,
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
            a_batch_stride: m * k,
            b_batch_stride: k * n,
            causal: Default::default(),
            tokens: Default::default(),
        };
        let operands: Vec<(Vec<f32>, Vec<f32>)> = (0..4u32)
            .map(|s| {
                let v = |len: usize, salt: u32| -> Vec<f32> {
                    (0..len as u32)
                        .map(|i| ((i.wrapping_mul(2654435761) ^ (s * 97 + salt)) % 1000) as f32 / 500.0 - 1.0)
                        .collect()
                };
                (v(m * k, 1), v(k * n, 2))
            })
            .collect();
        let want: Vec<Vec<f32>> = operands.iter().map(|(a, b)| naive(a, b, d, None)).collect();
        std::thread::scope(|sc| {
            for ((a, b), want) in operands.iter().zip(&want) {
                sc.spawn(move || {
                    for _ in 0..12 {
                        let got = matmul_f32(Src::F32(a), Src::F32(b), d, None, None);
                        assert!(got.iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()));
                    }
                });
            }
        });
    }

    /// Causal products skip exactly the terms and outputs they leave out:
    /// the plain loop with the same predicate, bit for bit, also where the
    /// skipped part of an operand holds inf or NaN (so nothing is added as a
    /// zero), over ragged sizes, several k-blocks, row-split and batch-split
    /// threading and every layout.
    #[test]
    fn causal_products_skip_exactly_what_they_leave_out() {
        let mut next = lcg(7);
        const { assert!(1200 * 1200 * 64 >= THREADED_MACS && 48 * 300 * 300 * 20 >= THREADED_MACS) };
        for &(batch, t, n, rounds) in &[
            (1, 1, 1, true),
            (2, 7, 5, true),
            (3, 13, 17, true),
            (1, 40, 33, true),
            (2, 400, 20, true), // two k-blocks (204 + 196 terms)
            (1, 1200, 64, false), // rows split over threads
            (48, 300, 20, false), // batch split over threads
        ] {
            for causal in [Causal::Outputs, Causal::TermsUpToRow, Causal::TermsFromRow] {
                // Outputs: (t × n) · (n × t); the others (t × t) · (t × n).
                let (m, k, n) = if causal == Causal::Outputs { (t, n, t) } else { (t, t, n) };
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let fmts: &[Option<Format>] = if rounds { &[None, Some(Format::Bf16)] } else { &[None] };
                    for &round in fmts {
                        let mut val = |_| match next() % 97 {
                            0 => f32::INFINITY,
                            1 => f32::NAN,
                            _ => (next() as f32 / 4e9) - 0.5,
                        };
                        let a: Vec<f32> = (0..batch * m * k).map(&mut val).collect();
                        let b: Vec<f32> = (0..batch * k * n).map(&mut val).collect();
                        every_kernel_is_the_plain_loop(&a, &b, dims(batch, (m, k, n), (ta, tb), causal), round);
                    }
                }
            }
        }
    }
}
