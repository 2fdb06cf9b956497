//! Prints the kernels as NVRTC compiles them (PTX) for an architecture
//! (`sm_90` unless given), from kernels.cu or from a variant of it given
//! after the architecture: for reading what a kernel compiles to, such as
//! whether it spills registers to local memory. Needs NVRTC, not a GPU.
//!
//!     ptx [ARCH] [KERNELS.cu] [NAME=VALUE]...
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arch = args.first().cloned().unwrap_or_else(|| "sm_90".into());
    let (source, defines) = match args.get(1) {
        Some(f) if !f.contains('=') => match std::fs::read_to_string(f) {
            Ok(s) => (s, args[2..].to_vec()),
            Err(e) => {
                eprintln!("ptx: {f}: {e}");
                std::process::exit(1);
            }
        },
        _ => (
            snug_cuda::SOURCE.to_string(),
            args.get(1..).unwrap_or_default().to_vec(),
        ),
    };
    match snug_cuda::compile_source(&arch, &source, &defines) {
        Ok(ptx) => print!("{ptx}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
