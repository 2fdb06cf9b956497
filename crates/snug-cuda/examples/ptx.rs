//! Prints the kernels as NVRTC compiles them (PTX) for an architecture
//! (`sm_90` unless given): for reading what a kernel compiles to, such as
//! whether it spills registers to local memory. Needs NVRTC, not a GPU.
fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90".into());
    match snug_cuda::compile(&arch) {
        Ok(ptx) => print!("{ptx}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
