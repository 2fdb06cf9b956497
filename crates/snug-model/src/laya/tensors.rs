//! The checkpoint's tensors (`model.safetensors`): mapped, each one's
//! name, type and shape checked when it is bound.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dtype {
    F16,
    F32,
}

pub(crate) enum Storage {
    Mapped {
        dtype: Dtype,
        range: Range<usize>,
    },
    Owned(Vec<f32>),
    /// A tensor of a type no weight uses (integer buffers such as
    /// `position_ids`): listed, refused only if something binds it.
    Other(String),
}

pub(crate) struct TensorEntry {
    pub(crate) shape: Vec<usize>,
    pub(super) storage: Storage,
}

/// The tensors of `model.safetensors`, memory-mapped.
pub(crate) struct Tensors {
    pub(super) path: PathBuf,
    pub(super) map: Mmap,
    pub(crate) entries: HashMap<String, TensorEntry>,
}

impl Tensors {
    pub(crate) fn open(path: &Path) -> Result<Tensors, LayaError> {
        let file = snug_core::durable::open_regular(path).map_err(io_err(path))?;
        // SAFETY: the file is opened read-only and treated as immutable;
        // replacing a checkpoint under a running process is unsupported.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| format_err(path, format!("not a safetensors file: {e}")))?;
        let base = 8 + header_len;
        let mut entries = HashMap::new();
        for (name, info) in meta.tensors() {
            let (start, end) = info.data_offsets;
            let range = base + start..base + end;
            if range.end > map.len() || start > end {
                return Err(format_err(
                    path,
                    format!("tensor {name} lies past the end of the file (truncated?)"),
                ));
            }
            let storage = match info.dtype {
                safetensors::Dtype::F16 if (map.as_ptr() as usize + range.start).is_multiple_of(2) => Storage::Mapped {
                    dtype: Dtype::F16,
                    range,
                },
                safetensors::Dtype::F32 if (map.as_ptr() as usize + range.start).is_multiple_of(4) => Storage::Mapped {
                    dtype: Dtype::F32,
                    range,
                },
                safetensors::Dtype::F16 => Storage::Owned(
                    map[range]
                        .chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                ),
                safetensors::Dtype::F32 => Storage::Owned(
                    map[range]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                ),
                safetensors::Dtype::BF16 => Storage::Owned(
                    map[range]
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                ),
                other => Storage::Other(format!("{other:?}")),
            };
            entries.insert(
                name.clone(),
                TensorEntry {
                    shape: info.shape.clone(),
                    storage,
                },
            );
        }
        Ok(Tensors {
            path: path.to_path_buf(),
            map,
            entries,
        })
    }

    pub(crate) fn entry(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry, LayaError> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| format_err(&self.path, format!("tensor {name} is missing")))?;
        if e.shape != shape {
            return Err(format_err(
                &self.path,
                format!("tensor {name} has shape {:?}; the configs say {shape:?}", e.shape),
            ));
        }
        Ok(e)
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// A matrix (`rows x cols`), or a vector (`cols == 0` means 1-D of `rows`).
    pub(crate) fn dense(&self, name: &str, rows: usize, cols: usize) -> Result<Dense<'_>, LayaError> {
        let shape: Vec<usize> = if cols == 0 { vec![rows] } else { vec![rows, cols] };
        let e = self.entry(name, &shape)?;
        let data = match &e.storage {
            Storage::Owned(v) => DenseData::F32(v),
            Storage::Other(dtype) => {
                return Err(format_err(
                    &self.path,
                    format!("tensor {name}: dtype {dtype} is not supported"),
                ))
            }
            Storage::Mapped { dtype, range } => {
                let bytes = &self.map[range.clone()];
                match dtype {
                    // SAFETY: alignment was checked when the entry was made;
                    // the length is a whole number of elements.
                    Dtype::F16 => DenseData::F16(unsafe {
                        std::slice::from_raw_parts(bytes.as_ptr() as *const u16, bytes.len() / 2)
                    }),
                    Dtype::F32 => DenseData::F32(unsafe {
                        std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4)
                    }),
                }
            }
        };
        Ok(Dense {
            rows,
            cols: cols.max(1),
            data,
        })
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LayaError> {
        let d = self.dense(name, len, 0)?;
        let mut out = vec![0f32; len];
        match d.data {
            DenseData::F16(h) => out
                .iter_mut()
                .zip(h)
                .for_each(|(o, &b)| *o = f16::from_bits(b).to_f32()),
            DenseData::F32(f) => out.copy_from_slice(f),
        }
        Ok(out)
    }

    pub(crate) fn mapped_bytes(&self) -> usize {
        self.map.len()
    }
}
