//! `DeviceMesh`: the ranks of a group laid out as an N-D grid, row-major, with one process
//! group per mesh dimension (`torch.distributed.device_mesh.init_device_mesh`).
//!
//! Hybrid sharding uses a 2-D mesh of shape `(R, S)` named `("replicate", "shard")`: dim 1
//! groups `S` consecutive ranks (one node, the shard group), dim 0 groups the ranks with the
//! same index on each node (the replicate group).
//!
//! ```text
//! mesh (2, 3)     dim 0 groups (columns)   dim 1 groups (rows)
//! [[0, 1, 2],     {0, 3} {1, 4} {2, 5}     {0, 1, 2} {3, 4, 5}
//!  [3, 4, 5]]
//! ```

use super::{Group, ProcessGroup};
use crate::error::{Error, Result};

/// A mesh dimension, by index or by name (torch's `mesh_dim: int | str`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeshDim<'a> {
    /// Dimension index, `0..ndim`.
    Index(usize),
    /// Dimension name given at construction, e.g. `"shard"`.
    Name(&'a str),
}

impl From<usize> for MeshDim<'_> {
    fn from(i: usize) -> Self {
        MeshDim::Index(i)
    }
}

impl<'a> From<&'a str> for MeshDim<'a> {
    fn from(s: &'a str) -> Self {
        MeshDim::Name(s)
    }
}

/// One rank's view of an N-D mesh of ranks: the whole layout, its coordinate, and its
/// process group along every dimension. Cheap to clone (groups are shared handles).
#[derive(Clone)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    names: Option<Vec<String>>,
    /// World ranks, row-major over `shape`.
    mesh: Vec<usize>,
    coordinate: Vec<usize>,
    /// This rank's group along each dimension.
    groups: Vec<Group>,
    rank: usize,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("shape", &self.shape)
            .field("mesh_dim_names", &self.names)
            .field("mesh", &self.mesh)
            .field("rank", &self.rank)
            .field("coordinate", &self.coordinate)
            .finish()
    }
}

/// `torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape, mesh_dim_names=...)`
/// over the members of `group` (usually the world): see [`DeviceMesh::new`].
///
/// # Errors
/// As [`DeviceMesh::new`].
pub fn init_device_mesh(
    group: &dyn ProcessGroup,
    mesh_shape: &[usize],
    mesh_dim_names: &[&str],
) -> Result<DeviceMesh> {
    DeviceMesh::new(group, mesh_shape, mesh_dim_names)
}

impl DeviceMesh {
    /// Lays the members of `group` (in group-rank order) out row-major in `mesh_shape` and
    /// creates, with [`ProcessGroup::new_group`], the group of every row along every
    /// dimension, dimension 0 first. Every rank of `group` must call it, in the same order
    /// relative to its other `new_group` calls. `mesh_dim_names` is empty (dimensions by
    /// index only) or one distinct, non-empty name per dimension.
    ///
    /// # Errors
    /// `InvalidArgument` when the shape is empty, has a zero, or does not multiply to
    /// `group.size()`, or for bad names; whatever `new_group` reports.
    pub fn new(
        group: &dyn ProcessGroup,
        mesh_shape: &[usize],
        mesh_dim_names: &[&str],
    ) -> Result<Self> {
        let n: usize = mesh_shape.iter().product();
        if mesh_shape.is_empty() || mesh_shape.contains(&0) || n != group.size() {
            crate::error::bail_arg!(
                "init_device_mesh: mesh shape {mesh_shape:?} must have positive dimensions multiplying to the group size {}",
                group.size()
            );
        }
        let names = if mesh_dim_names.is_empty() {
            None
        } else {
            let distinct = mesh_dim_names
                .iter()
                .enumerate()
                .all(|(i, a)| !a.is_empty() && !mesh_dim_names[..i].contains(a));
            if mesh_dim_names.len() != mesh_shape.len() || !distinct {
                crate::error::bail_arg!(
                    "init_device_mesh: mesh_dim_names {mesh_dim_names:?} must be {} distinct non-empty names, one per dimension of {mesh_shape:?}",
                    mesh_shape.len()
                );
            }
            Some(mesh_dim_names.iter().map(|s| s.to_string()).collect())
        };
        let mesh = group.ranks();
        let me = group.rank();
        let strides: Vec<usize> = (0..mesh_shape.len())
            .map(|d| mesh_shape[d + 1..].iter().product())
            .collect();
        let coord_of = |i: usize| -> Vec<usize> {
            strides
                .iter()
                .zip(mesh_shape)
                .map(|(s, len)| i / s % len)
                .collect()
        };
        let coordinate = coord_of(me);
        let mut groups = Vec::with_capacity(mesh_shape.len());
        for d in 0..mesh_shape.len() {
            let mut mine = None;
            for base in (0..n).filter(|&i| coord_of(i)[d] == 0) {
                let ranks: Vec<usize> = (0..mesh_shape[d])
                    .map(|k| mesh[base + k * strides[d]])
                    .collect();
                if let Some(g) = group.new_group(&ranks)? {
                    mine = Some(g);
                }
            }
            groups.push(mine.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "init_device_mesh: rank {} is in no group along mesh dimension {d}",
                    group.world_rank()
                ))
            })?);
        }
        Ok(DeviceMesh {
            shape: mesh_shape.to_vec(),
            names,
            rank: mesh[me],
            mesh,
            coordinate,
            groups,
        })
    }

    fn dim<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<usize> {
        match dim.into() {
            MeshDim::Index(i) if i < self.shape.len() => Ok(i),
            MeshDim::Index(i) => Err(Error::InvalidArgument(format!(
                "DeviceMesh: dimension {i} is out of range for a {}-D mesh",
                self.shape.len()
            ))),
            MeshDim::Name(s) => self
                .names
                .as_ref()
                .and_then(|names| names.iter().position(|n| n == s))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "DeviceMesh: no dimension named '{s}' (names: {:?})",
                        self.names
                    ))
                }),
        }
    }

    /// Number of dimensions (`DeviceMesh.ndim`).
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The mesh shape (`DeviceMesh.shape`), e.g. `[R, S]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// World ranks of the mesh, row-major over [`shape`](Self::shape) (`DeviceMesh.mesh`
    /// flattened): rank at coordinate `(i, j)` of a 2-D mesh is `mesh()[i * S + j]`.
    pub fn mesh(&self) -> &[usize] {
        &self.mesh
    }

    /// Dimension names given at construction (`DeviceMesh.mesh_dim_names`).
    pub fn mesh_dim_names(&self) -> Option<&[String]> {
        self.names.as_deref()
    }

    /// Number of ranks in the whole mesh (`DeviceMesh.size()`).
    pub fn numel(&self) -> usize {
        self.mesh.len()
    }

    /// Number of ranks along `dim` (`DeviceMesh.size(mesh_dim)`).
    ///
    /// # Errors
    /// `InvalidArgument` for an unknown dimension.
    pub fn size<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<usize> {
        Ok(self.shape[self.dim(dim)?])
    }

    /// This rank's group along `dim`: the ranks that differ from it only in that coordinate
    /// (`DeviceMesh.get_group(mesh_dim)`).
    ///
    /// # Errors
    /// `InvalidArgument` for an unknown dimension.
    pub fn get_group<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<Group> {
        Ok(self.groups[self.dim(dim)?].clone())
    }

    /// This rank's coordinate along `dim`, which is also its rank in
    /// [`get_group(dim)`](Self::get_group) (`DeviceMesh.get_local_rank(mesh_dim)`).
    ///
    /// # Errors
    /// `InvalidArgument` for an unknown dimension.
    pub fn get_local_rank<'a>(&self, dim: impl Into<MeshDim<'a>>) -> Result<usize> {
        Ok(self.coordinate[self.dim(dim)?])
    }

    /// This rank's coordinate in the mesh (`DeviceMesh.get_coordinate()`).
    pub fn get_coordinate(&self) -> &[usize] {
        &self.coordinate
    }

    /// This rank's world rank (`DeviceMesh.get_rank()`).
    pub fn get_rank(&self) -> usize {
        self.rank
    }
}
