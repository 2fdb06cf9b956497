//! A GGUF reader written for hostile input.
//!
//! GGUF (versions 2 and 3, little-endian) is a header, a list of typed
//! metadata key/values, a list of tensor infos, padding to the file's
//! alignment, then the tensor data:
//!
//! ```text
//! "GGUF" | version u32 | n_tensors u64 | n_kv u64
//! | kv*: key (u64 len + utf8) | type u32 | value
//! | tensor_info*: name | n_dims u32 | dims u64[n_dims] | type u32 | offset u64
//! | pad to alignment | data (each tensor at data_start + offset)
//! ```
//!
//! Every count and length read from the file is capped (see the `MAX_*`
//! constants) and checked against the bytes that remain, so a crafted file
//! can neither exhaust memory nor overflow an integer; every tensor's extent
//! is checked against the file. Parsing works on a byte slice (so the fuzz
//! target needs no file); [`GgufFile::open`] memory-maps the file and keeps
//! the map, from which tensors are borrowed without copying.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use memmap2::Mmap;

use crate::mapping::{mapping_rss, release_range};
use snug_kernels::GgmlType;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Longest string (key, value or tensor name) accepted, in bytes. Chat
/// templates are the longest strings in real files (tens of KiB).
pub const MAX_STRING_LEN: u64 = 16 << 20;
/// Most elements in one metadata array. Vocabularies and merge lists reach
/// a few hundred thousand.
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Deepest nesting of arrays inside arrays.
pub const MAX_ARRAY_DEPTH: usize = 2;
/// Most metadata key/value pairs.
pub const MAX_KV_COUNT: u64 = 1 << 16;
/// Most tensors.
pub const MAX_TENSOR_COUNT: u64 = 1 << 20;
/// Most dimensions of one tensor (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Largest alignment accepted.
pub const MAX_ALIGNMENT: u32 = 1 << 16;
/// The alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u32 = 32;

/// What is wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file (starts with {found:?}, expected \"GGUF\")")]
    NotGguf { found: String },
    #[error("unsupported GGUF version {0} (supported: 2 and 3, little-endian)")]
    UnsupportedVersion(u32),
    #[error("GGUF file is big-endian, which is not supported")]
    BigEndian,
    #[error("GGUF file is truncated: {what} at byte {offset} needs {needed} bytes, {available} remain")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("GGUF {what} is {value}, over the limit of {limit}")]
    TooLarge { what: String, value: u64, limit: u64 },
    #[error("GGUF {what} at byte {offset} is not valid UTF-8")]
    BadUtf8 { what: String, offset: u64 },
    #[error("GGUF metadata key {key:?} has unknown value type {ty}")]
    BadValueType { key: String, ty: u32 },
    #[error("GGUF metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("GGUF tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("GGUF tensor {name:?}: {problem}")]
    BadTensor { name: String, problem: String },
    #[error("GGUF general.alignment {0} is not a power of two up to 65536")]
    BadAlignment(u64),
    #[error("GGUF metadata key {key:?}: {problem}")]
    BadMetadata { key: String, problem: String },
}

impl GgufError {
    fn bad_tensor(name: &str, problem: impl Into<String>) -> Self {
        GgufError::BadTensor {
            name: name.to_string(),
            problem: problem.into(),
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, stored by element type so a 262,144-entry vocabulary
/// costs one allocation per string rather than one enum per element.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "u8",
            Array::I8(_) => "i8",
            Array::U16(_) => "u16",
            Array::I16(_) => "i16",
            Array::U32(_) => "u32",
            Array::I32(_) => "i32",
            Array::F32(_) => "f32",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
            Array::U64(_) => "u64",
            Array::I64(_) => "i64",
            Array::F64(_) => "f64",
        }
    }
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of
    /// any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s:?}"),
            Value::Array(a) => write!(f, "[{} x {}]", a.len(), a.type_name()),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
        }
    }
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as ggml orders them.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Elements (product of `dims`).
    pub elements: u64,
    /// Bytes of data.
    pub size: u64,
}

/// The parsed header of a GGUF file: everything but the tensor bytes.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u32,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl GgufHeader {
    /// Parses and validates a whole GGUF file held in `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(GgufError::NotGguf {
                found: String::from_utf8_lossy(magic).into_owned(),
            });
        }
        let version = r.u32("version")?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(GgufError::BigEndian);
        }
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = r.u64("tensor count")?;
        cap("tensor count", n_tensors, MAX_TENSOR_COUNT)?;
        let n_kv = r.u64("metadata count")?;
        cap("metadata count", n_kv, MAX_KV_COUNT)?;

        let mut metadata = Vec::with_capacity(r.bounded_capacity(n_kv, 13));
        let mut index = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let value = r.value(&key, ty, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.push((key, value));
        }

        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_u64().ok_or_else(|| GgufError::BadMetadata {
                    key: "general.alignment".into(),
                    problem: "not an integer".into(),
                })?;
                if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT as u64 {
                    return Err(GgufError::BadAlignment(a));
                }
                a as u32
            }
        };

        let mut tensors = Vec::with_capacity(r.bounded_capacity(n_tensors, 24));
        let mut tensor_index = HashMap::new();
        for _ in 0..n_tensors {
            let t = r.tensor_info()?;
            if tensor_index.insert(t.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(t.name));
            }
            tensors.push(t);
        }

        let data_offset = align_up(r.pos as u64, alignment as u64);
        let file_len = bytes.len() as u64;
        for t in &tensors {
            if t.offset % alignment as u64 != 0 {
                return Err(GgufError::bad_tensor(
                    &t.name,
                    format!("data offset {} is not aligned to {}", t.offset, alignment),
                ));
            }
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.size))
                .ok_or_else(|| GgufError::bad_tensor(&t.name, "data extent overflows"))?;
            if end > file_len {
                return Err(GgufError::Truncated {
                    what: format!("data of tensor {:?}", t.name),
                    offset: data_offset.saturating_add(t.offset),
                    needed: t.size,
                    available: file_len.saturating_sub(data_offset.saturating_add(t.offset)),
                });
            }
        }
        Ok(GgufHeader {
            version,
            metadata,
            index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Option<&Array> {
        self.get(key).and_then(Value::as_array)
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// `general.architecture`, the prefix of the model's own keys.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }
}

/// A memory-mapped GGUF file. Tensor data is borrowed from the map.
pub struct GgufFile {
    pub header: GgufHeader,
    mmap: Mmap,
    path: std::path::PathBuf,
    modified: Option<std::time::SystemTime>,
}

impl GgufFile {
    /// Opens, maps and validates the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = snug_core::durable::open_regular(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.len() < 24 {
            // Too short for the fixed header; also avoids mapping an empty file.
            let head = snug_core::durable::read_regular(path).map_err(io)?;
            return Err(GgufHeader::parse(&head).err().unwrap_or(GgufError::Truncated {
                what: "header".into(),
                offset: 0,
                needed: 24,
                available: head.len() as u64,
            }));
        }
        // SAFETY: the map is read-only. Like every mmap-based model loader,
        // this assumes the file is not truncated by another process while
        // mapped; weights are immutable by design.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = GgufHeader::parse(&mmap)?;
        Ok(GgufFile {
            header,
            mmap,
            path: path.to_path_buf(),
            modified: meta.modified().ok(),
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's modification time, where the system tells it.
    pub fn modified(&self) -> Option<std::time::SystemTime> {
        self.modified
    }

    /// Drops this process' resident pages of `bytes` (tensor data lent by
    /// this file); they are read again on next use. Returns the bytes
    /// advised, 0 when `bytes` is not in this file.
    pub fn release(&self, bytes: &[u8]) -> u64 {
        release_range(&self.mmap, bytes)
    }

    /// Gives back every resident page of the file (they are read again
    /// from the file if needed).
    pub fn release_all(&self) {
        // SAFETY: the map is a read-only view of a file, so dropped pages
        // are re-read unchanged on access.
        #[cfg(unix)]
        let _ = unsafe { self.mmap.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
    }

    /// The bytes of tensor `t` (which must come from this file's header).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + t.offset) as usize;
        &self.mmap[start..start + t.size as usize]
    }

    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.mmap.len() as u64
    }

    /// Bytes of the mapped file resident in this process's memory (what
    /// the resident set size counts for the mapping: `Rss` of its entry in
    /// `/proc/self/smaps`), or `None` where the system cannot tell.
    pub fn resident_bytes(&self) -> Option<u64> {
        // The mapping ends on a page boundary; the file need not.
        mapping_rss(self.mmap.as_ptr() as usize).map(|b| b.min(self.file_size()))
    }
}

impl std::ops::Deref for GgufFile {
    type Target = GgufHeader;
    fn deref(&self) -> &GgufHeader {
        &self.header
    }
}

fn cap(what: &str, value: u64, limit: u64) -> Result<(), GgufError> {
    if value > limit {
        return Err(GgufError::TooLarge {
            what: what.to_string(),
            value,
            limit,
        });
    }
    Ok(())
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

macro_rules! read_le {
    ($name:ident, $t:ty) => {
        fn $name(&mut self, what: &str) -> Result<$t, GgufError> {
            let b = self.take(std::mem::size_of::<$t>(), what)?;
            Ok(<$t>::from_le_bytes(
                b.try_into().expect("take returns the size asked"),
            ))
        }
    };
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n as u64,
                available: self.remaining() as u64,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// A capacity to reserve for `count` items of at least `min_size` bytes
    /// each: never more than the remaining bytes could hold.
    fn bounded_capacity(&self, count: u64, min_size: usize) -> usize {
        count.min((self.remaining() / min_size.max(1)) as u64) as usize
    }

    read_le!(u8, u8);
    read_le!(i8, i8);
    read_le!(u16, u16);
    read_le!(i16, i16);
    read_le!(u32, u32);
    read_le!(i32, i32);
    read_le!(u64, u64);
    read_le!(i64, i64);
    read_le!(f32, f32);
    read_le!(f64, f64);

    fn bool(&mut self, what: &str) -> Result<bool, GgufError> {
        Ok(self.u8(what)? != 0)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        cap(&format!("{what} length"), len, MAX_STRING_LEN)?;
        let at = self.pos as u64;
        let b = self.take(len as usize, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::BadUtf8 {
            what: what.to_string(),
            offset: at,
        })
    }

    fn value(&mut self, key: &str, ty: u32, depth: usize) -> Result<Value, GgufError> {
        let what = key;
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.i8(what)?),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.i16(what)?),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.i32(what)?),
            6 => Value::F32(self.f32(what)?),
            7 => Value::Bool(self.bool(what)?),
            8 => Value::String(self.string(what)?),
            9 => Value::Array(self.array(key, depth)?),
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.i64(what)?),
            12 => Value::F64(self.f64(what)?),
            _ => {
                return Err(GgufError::BadValueType {
                    key: key.to_string(),
                    ty,
                })
            }
        })
    }

    fn array(&mut self, key: &str, depth: usize) -> Result<Array, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::TooLarge {
                what: format!("array nesting of {key:?}"),
                value: depth as u64 + 1,
                limit: MAX_ARRAY_DEPTH as u64,
            });
        }
        let ty = self.u32(key)?;
        let len = self.u64(key)?;
        cap(&format!("array length of {key:?}"), len, MAX_ARRAY_LEN)?;
        macro_rules! fixed {
            ($variant:ident, $read:ident, $size:expr) => {{
                let needed = len * $size;
                if needed > self.remaining() as u64 {
                    return Err(GgufError::Truncated {
                        what: format!("array {key:?}"),
                        offset: self.pos as u64,
                        needed,
                        available: self.remaining() as u64,
                    });
                }
                let mut v = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    v.push(self.$read(key)?);
                }
                Array::$variant(v)
            }};
        }
        Ok(match ty {
            0 => fixed!(U8, u8, 1),
            1 => fixed!(I8, i8, 1),
            2 => fixed!(U16, u16, 2),
            3 => fixed!(I16, i16, 2),
            4 => fixed!(U32, u32, 4),
            5 => fixed!(I32, i32, 4),
            6 => fixed!(F32, f32, 4),
            7 => fixed!(Bool, bool, 1),
            10 => fixed!(U64, u64, 8),
            11 => fixed!(I64, i64, 8),
            12 => fixed!(F64, f64, 8),
            8 => {
                let mut v = Vec::with_capacity(self.bounded_capacity(len, 8));
                for _ in 0..len {
                    v.push(self.string(key)?);
                }
                Array::String(v)
            }
            9 => {
                let mut v = Vec::with_capacity(self.bounded_capacity(len, 12));
                for _ in 0..len {
                    v.push(self.array(key, depth + 1)?);
                }
                Array::Array(v)
            }
            _ => {
                return Err(GgufError::BadValueType {
                    key: key.to_string(),
                    ty,
                })
            }
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo, GgufError> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::bad_tensor(
                &name,
                format!("{n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut elements: u64 = 1;
        for _ in 0..n_dims {
            let d = self.u64("tensor dimension")?;
            if d == 0 || d > i64::MAX as u64 {
                return Err(GgufError::bad_tensor(&name, format!("dimension {d} is out of range")));
            }
            elements = elements
                .checked_mul(d)
                .filter(|&e| e <= i64::MAX as u64)
                .ok_or_else(|| GgufError::bad_tensor(&name, "element count overflows"))?;
            dims.push(d);
        }
        let ty_id = self.u32("tensor type")?;
        let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
            let what = match snug_kernels::quant::foreign_type_name(ty_id) {
                Some(n) => format!("tensor type {n} is not supported"),
                None => format!("unknown tensor type {ty_id}"),
            };
            GgufError::bad_tensor(&name, format!("{what} (snug runs {})", supported_types()))
        })?;
        if dims[0] % ty.block_size() as u64 != 0 {
            return Err(GgufError::bad_tensor(
                &name,
                format!(
                    "row length {} is not a multiple of the {} block size {}",
                    dims[0],
                    ty,
                    ty.block_size()
                ),
            ));
        }
        let size = ty
            .bytes_for(elements)
            .ok_or_else(|| GgufError::bad_tensor(&name, "byte size overflows"))?;
        let offset = self.u64("tensor offset")?;
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            elements,
            size,
        })
    }
}

/// The tensor types snug runs, for errors.
pub fn supported_types() -> String {
    GgmlType::ALL
        .into_iter()
        .filter(|t| snug_kernels::matmul::matmul_supports(*t))
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a small valid GGUF file in memory.
    pub(crate) fn tiny_gguf() -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&3u64.to_le_bytes()); // kv
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend_from_slice(&(s.len() as u64).to_le_bytes());
            b.extend_from_slice(s.as_bytes());
        };
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "b");
        s(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        // tensor: "w", 2 dims [32, 2], q8_0, offset 0
        s(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&32u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(7u8, 68));
        b
    }

    #[test]
    fn parses_a_minimal_file() {
        let b = tiny_gguf();
        let h = GgufHeader::parse(&b).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.architecture(), Some("llama"));
        assert_eq!(h.get_u64("llama.block_count"), Some(2));
        assert_eq!(h.get_array("tokenizer.ggml.tokens").map(Array::len), Some(2));
        let t = h.tensor("w").unwrap();
        assert_eq!((t.elements, t.size, t.ty), (64, 68, GgmlType::Q8_0));
        assert_eq!(h.data_offset % 32, 0);
    }

    #[test]
    fn a_type_snug_does_not_run_is_named_with_those_it_does() {
        // The tensor's second dimension (2) and its type (q8_0 = 8).
        let at = |b: &[u8]| {
            let pat = [2, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0];
            b.windows(12).position(|w| w == pat).unwrap() + 8
        };
        for (id, want) in [
            (16u32, "tensor type iq2_xxs is not supported"),
            (99, "unknown tensor type 99"),
        ] {
            let mut b = tiny_gguf();
            let i = at(&b);
            b[i..i + 4].copy_from_slice(&id.to_le_bytes());
            let e = GgufHeader::parse(&b).err().unwrap().to_string();
            assert!(e.contains(want) && e.contains("q4_K") && e.contains("iq4_xs"), "{e}");
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = tiny_gguf();
        for n in 0..b.len() {
            assert!(GgufHeader::parse(&b[..n]).is_err(), "prefix of {n} bytes parsed");
        }
    }

    #[test]
    fn rejects_wrong_magic_version_and_endianness() {
        let mut b = tiny_gguf();
        b[0] = b'X';
        assert!(matches!(GgufHeader::parse(&b), Err(GgufError::NotGguf { .. })));
        let mut b = tiny_gguf();
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(GgufHeader::parse(&b), Err(GgufError::UnsupportedVersion(1))));
        let mut b = tiny_gguf();
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(matches!(GgufHeader::parse(&b), Err(GgufError::BigEndian)));
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        let mut b = tiny_gguf();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(GgufHeader::parse(&b), Err(GgufError::TooLarge { .. })));
        // An array claiming 2^24 strings in a tiny file: truncated, not OOM.
        let mut b = tiny_gguf();
        let at = b.windows(8).position(|w| w == 2u64.to_le_bytes()).unwrap();
        b[at..at + 8].copy_from_slice(&(MAX_ARRAY_LEN).to_le_bytes());
        assert!(GgufHeader::parse(&b).is_err());
    }

    #[test]
    fn random_byte_flips_never_panic() {
        let base = tiny_gguf();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            let mut b = base.clone();
            for _ in 0..3 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let at = (state % b.len() as u64) as usize;
                b[at] = (state >> 32) as u8;
            }
            let _ = GgufHeader::parse(&b);
        }
    }
}
