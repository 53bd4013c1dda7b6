//! The primitive trace: every backend primitive call in order — its name, its
//! shapes and parameters, a hash of its output — with the model path that
//! issued it (`layers.3.self_attn`) and the phase (forward, backward, the
//! recomputation of a segment, the optimizer). Two traces of the
//! same step, one per device, line up call for call; the first call whose
//! output hash differs is where the devices part.
//!
//! Off by default, per thread. Off, a path guard or a recorded call is one
//! thread-local flag read: nothing is formatted, hashed or read back. On, each
//! call's output is read back and hashed (a GPU sync per call: a trace is for
//! replaying one step, not for training).
//!
//! A leaf: the backend, the autograd and the layers call it, and it imports
//! nothing of the crate (no import runs back up).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// Where a graph node was made: the path when it was recorded, so its
/// backward is attributed to the layer whose forward made it.
pub type Site = Rc<str>;

/// One primitive call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// 0-based position in the trace.
    pub index: usize,
    /// `forward`, `backward`, `recompute` or `optimizer`.
    pub phase: &'static str,
    /// The model path, e.g. `layers.3.self_attn` (empty at the top).
    pub path: String,
    /// The primitive (the profile's name, e.g. `softmax`, `unary silu`).
    pub name: &'static str,
    /// Shapes and parameters.
    pub args: String,
    /// Output values hashed (every output buffer, then any scalar result).
    pub len: usize,
    /// FNV-1a over the output bits, every NaN as one canonical NaN (the
    /// contract promises NaN-ness, not payloads).
    pub hash: u64,
}

impl Call {
    /// `layers.3.self_attn.softmax`: the path and the primitive.
    pub fn site(&self) -> String {
        if self.path.is_empty() {
            self.name.to_string()
        } else {
            format!("{}.{}", self.path, self.name)
        }
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "call #{} ({}) {} [{}]",
            self.index,
            self.phase,
            self.site(),
            self.args
        )
    }
}

/// A finished trace: the calls, and the output values of the call that was
/// asked to be captured (see [`start`]).
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Every primitive call recorded, in order.
    pub calls: Vec<Call>,
    /// The output values of the call [`start`] was asked to capture (`None`
    /// when none was asked for, or the trace had fewer calls).
    pub captured: Option<Vec<f32>>,
}

impl Trace {
    /// The first position where the two traces differ (in the call, its
    /// arguments or its output), or where one ends before the other.
    pub fn first_difference(&self, other: &Trace) -> Option<usize> {
        let n = self.calls.len().min(other.calls.len());
        (0..n)
            .find(|&i| {
                let (a, b) = (&self.calls[i], &other.calls[i]);
                (a.name, &a.args, a.len, a.hash) != (b.name, &b.args, b.len, b.hash)
            })
            .or((self.calls.len() != other.calls.len()).then_some(n))
    }
}

struct State {
    calls: Vec<Call>,
    capture: Option<usize>,
    captured: Option<Vec<f32>>,
    /// The path as one string, and the length before each pushed segment.
    path: String,
    marks: Vec<usize>,
    phase: &'static str,
}

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static STATE: RefCell<State> = const {
        RefCell::new(State {
            calls: Vec::new(),
            capture: None,
            captured: None,
            path: String::new(),
            marks: Vec::new(),
            phase: "forward",
        })
    };
}

/// Whether this thread is recording a trace.
#[inline]
pub fn on() -> bool {
    ON.with(Cell::get)
}

/// Starts recording on this thread (an empty trace, the top path, the forward
/// phase). `capture`: the index of one call whose output values to keep.
pub fn start(capture: Option<usize>) {
    STATE.with_borrow_mut(|s| {
        *s = State {
            calls: Vec::new(),
            capture,
            captured: None,
            path: String::new(),
            marks: Vec::new(),
            phase: "forward",
        }
    });
    ON.with(|on| on.set(true));
}

/// Stops recording and returns the trace (empty if none was running).
pub fn finish() -> Trace {
    ON.with(|on| on.set(false));
    STATE.with_borrow_mut(|s| Trace {
        calls: std::mem::take(&mut s.calls),
        captured: s.captured.take(),
    })
}

/// Records one call (the backend calls it after every primitive while a
/// trace runs). `values` are the outputs, read back.
pub fn record(name: &'static str, args: String, values: Vec<f32>) {
    let hash = hash(&values);
    STATE.with_borrow_mut(|s| {
        let index = s.calls.len();
        if s.capture == Some(index) {
            s.captured = Some(values.clone());
        }
        s.calls.push(Call {
            index,
            phase: s.phase,
            path: s.path.clone(),
            name,
            args,
            len: values.len(),
            hash,
        });
    });
}

/// FNV-1a over the values' bits (NaN canonical).
pub fn hash(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        let b = if v.is_nan() { 0x7fc0_0000 } else { v.to_bits() };
        for byte in b.to_le_bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Restores the path (and phase) it replaced when dropped.
#[must_use]
pub struct PathGuard(Option<Restore>);

enum Restore {
    /// Pop back to this length.
    Pop,
    /// Put back a whole path and phase (after a backward node's site).
    Swap(String, Vec<usize>, &'static str),
    Phase(&'static str),
}

impl Drop for PathGuard {
    fn drop(&mut self) {
        let Some(r) = self.0.take() else { return };
        STATE.with_borrow_mut(|s| match r {
            Restore::Pop => {
                if let Some(m) = s.marks.pop() {
                    s.path.truncate(m);
                }
            }
            Restore::Swap(path, marks, phase) => {
                s.path = path;
                s.marks = marks;
                s.phase = phase;
            }
            Restore::Phase(p) => s.phase = p,
        });
    }
}

/// Appends `segment` to the path until the guard drops (a no-op when off).
pub fn path(segment: &str) -> PathGuard {
    if !on() {
        return PathGuard(None);
    }
    push(segment)
}

/// [`path`] with a segment built only when a trace runs (`layers.{i}`).
pub fn path_with(segment: impl FnOnce() -> String) -> PathGuard {
    if !on() {
        return PathGuard(None);
    }
    push(&segment())
}

fn push(segment: &str) -> PathGuard {
    STATE.with_borrow_mut(|s| {
        s.marks.push(s.path.len());
        if !s.path.is_empty() {
            s.path.push('.');
        }
        s.path.push_str(segment);
    });
    PathGuard(Some(Restore::Pop))
}

/// Sets the phase until the guard drops (a no-op when off).
pub fn phase(p: &'static str) -> PathGuard {
    if !on() {
        return PathGuard(None);
    }
    let prev = STATE.with_borrow_mut(|s| std::mem::replace(&mut s.phase, p));
    PathGuard(Some(Restore::Phase(prev)))
}

/// The current path, for a graph node being recorded (`None` when off: a
/// node then carries nothing).
pub fn site() -> Option<Site> {
    if !on() {
        return None;
    }
    Some(STATE.with_borrow(|s| Rc::from(s.path.as_str())))
}

/// Runs a node's backward at the site that recorded it, in the backward
/// phase, until the guard drops.
pub fn backward_at(site: Option<&Site>) -> PathGuard {
    if !on() {
        return PathGuard(None);
    }
    let at = site.map(|s| s.to_string()).unwrap_or_default();
    STATE.with_borrow_mut(|s| {
        let marks = if at.is_empty() { vec![] } else { vec![0] };
        let path = std::mem::replace(&mut s.path, at);
        let marks = std::mem::replace(&mut s.marks, marks);
        let phase = std::mem::replace(&mut s.phase, "backward");
        PathGuard(Some(Restore::Swap(path, marks, phase)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_phases_and_sites_only_while_on() {
        {
            let _p = path("layers.0");
            assert!(site().is_none());
            record("x", String::new(), vec![]);
        }
        start(Some(1));
        {
            let _l = path_with(|| format!("layers.{}", 3));
            let _a = path("self_attn");
            record("softmax", "rows 4".into(), vec![1.0, 2.0]);
            let s = site();
            {
                let _o = phase("optimizer");
                let _b = backward_at(s.as_ref());
                record("softmax backward", String::new(), vec![f32::NAN]);
            }
            record("matmul", String::new(), vec![-f32::NAN]);
        }
        record("top", String::new(), vec![0.0]);
        let t = finish();
        assert!(!on());
        let sites: Vec<(String, &str)> = t.calls.iter().map(|c| (c.site(), c.phase)).collect();
        assert_eq!(
            sites,
            [
                ("layers.3.self_attn.softmax".to_string(), "forward"),
                (
                    "layers.3.self_attn.softmax backward".to_string(),
                    "backward"
                ),
                ("layers.3.self_attn.matmul".to_string(), "forward"),
                ("top".to_string(), "forward"),
            ]
        );
        assert!(t.captured.as_ref().unwrap()[0].is_nan());
        // NaN payloads hash alike; other bits do not.
        assert_eq!(t.calls[1].hash, t.calls[2].hash);
        assert_ne!(hash(&[0.0]), hash(&[-0.0]));
        let mut u = t.clone();
        assert_eq!(t.first_difference(&u), None);
        u.calls[2].hash ^= 1;
        assert_eq!(t.first_difference(&u), Some(2));
        u.calls.truncate(2);
        assert_eq!(t.first_difference(&u), Some(2));
    }
}
