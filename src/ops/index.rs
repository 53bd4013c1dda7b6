//! Embedding lookup and its scatter-add backward.

use crate::{bail, Result, Tensor};

impl Tensor {
    /// Rows of a table: `self: (v, d)`, `ids: (n,)` -> `(n, d)`. Backward
    /// scatter-adds `g` into a `(v, d)` gradient, each row summed in ascending `i`
    /// (and added to the table's gradient gathered so far as it is written).
    pub fn embedding(&self, ids: &[u32]) -> Result<Tensor> {
        if self.dims() != 2 {
            bail!(Shape, "embedding table must be 2-d, got {:?}", self.shape());
        }
        let (v, d) = (self.shape()[0], self.shape()[1]);
        let s = self.storage().gather_rows(ids, d)?;
        let ids = ids.to_vec();
        Ok(Tensor::record_gathering(
            s,
            vec![ids.len(), d],
            "embedding",
            &[self],
            move |g, gathered| {
                let e = gathered.take(0).map(|e| e.storage());
                Ok(vec![Some(Tensor::from_storage(
                    g.storage().scatter_add_rows(&ids, v, d, e.as_ref())?,
                    &[v, d],
                )?)])
            },
        ))
    }
}
