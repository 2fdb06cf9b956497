//! Bytes of weights one decode step reads (every matrix, as panels where
//! they are packed, and one embedding row), for the decode roofline.
//! `cargo run --release -p snug-model --example bytes_per_token -- MODEL.gguf`

fn main() {
    let path = std::env::args().nth(1).expect("usage: bytes_per_token MODEL.gguf");
    let file = snug_model::ModelFiles::open(std::path::Path::new(&path), &Default::default()).expect("model opens");
    let model = snug_model::arch::Model::load(&file).expect("model loads");
    println!("{}", model.bytes_read_per_token());
}
