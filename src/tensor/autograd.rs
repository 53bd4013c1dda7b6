//! Grad mode, graph nodes and `backward`.
//!
//! A node is created only by [`Tensor::from_op`], and only when grad mode is on
//! and some parent requires grad. `backward` walks the graph once in
//! reverse topological order and *consumes* it: each node's vector-Jacobian
//! closure (and every value it saved) and its parent links are dropped the
//! moment the node has run, so an activation's memory is released as soon as the
//! last node that needs it is done — the property activation recompute
//! relies on to lower the peak during backward. A parameter's gradient goes
//! into its `.grad` as soon as the last node feeding it has run, not at the
//! parameter's later place in the order: the same sums in the same order,
//! without the finished gradients of a whole segment waiting in flight.

use super::{Meta, Tensor};
use crate::{bail, Result};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::{Rc, Weak};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether operations on this thread record graph nodes.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Sets grad mode for as long as the guard lives; dropping it (also while
/// unwinding from a panic) restores the mode that was active before.
#[must_use = "grad mode reverts when the guard is dropped"]
pub struct GradModeGuard {
    prev: bool,
}

impl Drop for GradModeGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Turns graph recording off until the guard is dropped. Guards nest.
pub fn no_grad() -> GradModeGuard {
    set_grad_enabled(false)
}

/// Turns graph recording on or off until the guard is dropped.
pub fn set_grad_enabled(on: bool) -> GradModeGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(on));
    GradModeGuard { prev }
}

/// A vector-Jacobian product: upstream gradient → one gradient per parent
/// (`None` for a parent that gets none). It may take a parent's gradient
/// gathered so far out of [`Gathered`] and return it with its own
/// contribution added (a kernel that adds as it writes), in the order
/// autograd would have added them. A parent it takes must get `Some`.
pub type Vjp = Box<dyn FnOnce(&Tensor, &mut Gathered) -> Result<Vec<Option<Tensor>>>>;

/// The gradients gathered for a node's parents when its backward runs: the
/// sums, in order, of every contribution of the nodes that ran before it —
/// or, for a leaf that this node alone feeds, the `.grad` earlier backward
/// passes left (gradient accumulation), which its one contribution joins.
pub struct Gathered<'a> {
    grads: &'a mut HashMap<usize, Tensor>,
    parents: &'a [Rc<Meta>],
    /// How many parent slots of the graph's nodes each tensor fills.
    uses: &'a HashMap<usize, usize>,
}

impl Gathered<'_> {
    /// Parent `i`'s gradient so far, taken out: the node's contribution for
    /// it must then be that gradient plus its own.
    pub(crate) fn take(&mut self, i: usize) -> Option<Tensor> {
        let p = &self.parents[i];
        if !p.requires_grad.get() {
            return None;
        }
        if let Some(g) = self.grads.remove(&p.id) {
            return Some(g);
        }
        // `.grad + contribution` is the sum the leaf would form when backward
        // reaches it; with a second use the contributions would sum first.
        if p.is_leaf && self.uses.get(&p.id) == Some(&1) {
            return p.grad.borrow_mut().take();
        }
        None
    }
}

/// Two nodes' backwards at once: their upstream gradients -> each one's
/// parents' gradients (as each node's own [`Vjp`] gives them, bit for bit).
pub type JointVjp = Box<dyn FnOnce(&Tensor, &Tensor) -> Result<[Vec<Option<Tensor>>; 2]>>;

/// A node's link to the other output of the primitive that made it (RoPE's
/// q and k): when backward reaches one of the two and the other's gradient
/// is complete too, one primitive runs both backwards ([`join`]).
pub(crate) struct Joint {
    /// Weak: two nodes holding each other would never be freed.
    other: Weak<Meta>,
    both: Rc<RefCell<Option<JointVjp>>>,
    /// Whether this node is the first of `both`'s arguments.
    first: bool,
}

/// Links the nodes of `a` and `b` (made by one primitive, each recorded
/// with its own backward) so that backward runs `both` for the two once
/// both gradients are complete; either node alone runs its own backward.
/// Nothing happens where either has no node (no grad mode, no parent
/// requiring grad).
pub(crate) fn join(a: &Tensor, b: &Tensor, both: JointVjp) {
    let (ma, mb) = (&a.0.meta, &b.0.meta);
    let (mut na, mut nb) = (ma.node.borrow_mut(), mb.node.borrow_mut());
    if let (Some(na), Some(nb)) = (na.as_mut(), nb.as_mut()) {
        let both = Rc::new(RefCell::new(Some(both)));
        na.joint = Some(Joint {
            other: Rc::downgrade(mb),
            both: both.clone(),
            first: true,
        });
        nb.joint = Some(Joint {
            other: Rc::downgrade(ma),
            both,
            first: false,
        });
    }
}

pub(crate) struct Node {
    pub(crate) name: &'static str,
    /// Graph links only: a parent's values stay alive only if `vjp` saved them.
    pub(crate) parents: Vec<Rc<Meta>>,
    pub(crate) vjp: Vjp,
    /// The other node this one's backward may run with.
    pub(crate) joint: Option<Joint>,
    /// The model path that recorded the node, while a primitive trace runs
    /// (`None` otherwise): its backward is traced at the same path.
    pub(crate) site: Option<crate::trace::Site>,
}

/// Reverse topological order of the graph under `root` (root first), iterative
/// so deep graphs cannot overflow the stack.
fn topo_order(root: &Rc<Meta>) -> Vec<Rc<Meta>> {
    let mut order = Vec::new();
    let mut seen = std::collections::HashSet::new();
    // (node, children pushed?)
    let mut stack = vec![(root.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id) {
            continue;
        }
        stack.push((t.clone(), true));
        if let Some(node) = t.node.borrow().as_ref() {
            for p in &node.parents {
                if p.requires_grad.get() && !seen.contains(&p.id) {
                    stack.push((p.clone(), false));
                }
            }
        }
    }
    order.reverse();
    order
}

/// How many parent slots of the nodes in `order` each tensor fills.
fn uses(order: &[Rc<Meta>]) -> HashMap<usize, usize> {
    let mut uses = HashMap::new();
    for t in order {
        if let Some(node) = t.node.borrow().as_ref() {
            for p in node.parents.iter().filter(|p| p.requires_grad.get()) {
                *uses.entry(p.id).or_insert(0) += 1;
            }
        }
    }
    uses
}

fn accumulate(map: &mut HashMap<usize, Tensor>, id: usize, g: Tensor) -> Result<()> {
    let g = match map.remove(&id) {
        Some(prev) => prev.add(&g)?,
        None => g,
    };
    map.insert(id, g);
    Ok(())
}

/// Hands a node's parents their gradients `pgrads` (the node `name` ran):
/// each is added into the parent's sum, and a leaf whose last contributor
/// this was gets its sum in `.grad`.
fn deliver(
    name: &str,
    parents: &[Rc<Meta>],
    pgrads: Vec<Option<Tensor>>,
    grads: &mut HashMap<usize, Tensor>,
    left: &mut HashMap<usize, usize>,
) -> Result<()> {
    for (p, pg) in parents.iter().zip(pgrads) {
        if let (true, Some(pg)) = (p.requires_grad.get(), pg) {
            if pg.shape() != p.shape.as_slice() {
                bail!(Shape, "backward of {name} produced a gradient of shape {:?} for an input of shape {:?}", pg.shape(), p.shape);
            }
            accumulate(grads, p.id, pg)?;
        }
        if p.requires_grad.get() {
            let n = left
                .get_mut(&p.id)
                .expect("every parent's uses are counted");
            *n -= 1;
            if *n == 0 && p.is_leaf {
                if let Some(g) = grads.remove(&p.id) {
                    p.accumulate_grad(g)?;
                }
            }
        }
    }
    Ok(())
}

pub(crate) fn backward(root: &Tensor, seed: Tensor) -> Result<()> {
    if !root.requires_grad() {
        bail!(Shape, "backward on a tensor that does not require grad (no parameter reached it, or it was made under no_grad)");
    }
    if seed.shape() != root.shape() {
        bail!(
            Shape,
            "backward seed of shape {:?} for a tensor of shape {:?}",
            seed.shape(),
            root.shape()
        );
    }
    // The backward pass itself builds no graph.
    let _g = no_grad();
    // In a primitive trace, the gradient sums between nodes are backward work.
    let _traced = crate::trace::phase("backward");
    let mut order = topo_order(&root.0.meta);
    let uses = uses(&order);
    // How many of the nodes still to run feed each tensor a gradient: its
    // sum is complete once the last of them has run. A leaf's goes into
    // `.grad` then instead of waiting in `grads` for the leaf's place in the
    // order; a joint node runs with its partner once the partner's is.
    let mut left = uses.clone();
    let mut grads: HashMap<usize, Tensor> = HashMap::new();
    grads.insert(root.id(), seed);
    // Pop from the back = walk the reverse topological order; each node is
    // dropped from `order` as soon as it is processed.
    order.reverse();
    while let Some(t) = order.pop() {
        let g = grads.remove(&t.id);
        if t.is_leaf {
            if let Some(g) = g {
                t.accumulate_grad(g)?;
            }
            continue;
        }
        let node = t.node.borrow_mut().take();
        let Some(g) = g else { continue };
        let Some(node) = node else {
            bail!(Shape, "backward through a graph that was already freed (a second backward over the same forward pass)");
        };
        let Node {
            name,
            parents,
            vjp,
            joint,
            site,
        } = node;
        // the partner, where its gradient is complete and its node not run
        let partner = joint.and_then(|j| {
            let other = j.other.upgrade()?;
            let complete =
                left.get(&other.id).is_none_or(|&n| n == 0) && grads.contains_key(&other.id);
            let both = j
                .both
                .borrow_mut()
                .take()
                .filter(|_| complete && other.node.borrow().is_some())?;
            Some((other, both, j.first))
        });
        if let Some((other, both, first)) = partner {
            let theirs = other.node.borrow_mut().take().expect("checked above");
            let og = grads.remove(&other.id).expect("checked above");
            let (g0, g1) = if first { (&g, &og) } else { (&og, &g) };
            let [p0, p1] = {
                let _at = crate::trace::backward_at(site.as_ref());
                both(g0, g1)
                    .map_err(|e| e.context(format!("backward of {name} and {}", theirs.name)))?
            };
            let (mine, other_grads) = if first { (p0, p1) } else { (p1, p0) };
            drop((g, og));
            deliver(name, &parents, mine, &mut grads, &mut left)?;
            deliver(
                theirs.name,
                &theirs.parents,
                other_grads,
                &mut grads,
                &mut left,
            )?;
            continue;
        }
        let pgrads = {
            let _at = crate::trace::backward_at(site.as_ref());
            let mut gathered = Gathered {
                grads: &mut grads,
                parents: &parents,
                uses: &uses,
            };
            vjp(&g, &mut gathered).map_err(|e| e.context(format!("backward of {name}")))?
        };
        drop(g);
        deliver(name, &parents, pgrads, &mut grads, &mut left)?;
    }
    Ok(())
}
