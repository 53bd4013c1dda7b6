use tinyllm::backend::Storage;
use tinyllm::Device;
fn main() {
    tinyllm::memory::keep_freed_host_memory();
    let (rows, n) = (64 * 128, 128);
    let mut x = vec![0.0f32; rows * n];
    for r in 0..rows {
        let t = r % n;
        for j in 0..n {
            x[r * n + j] = if j <= t {
                ((r * 31 + j * 17) % 1000) as f32 * 0.003 - 1.5
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    let s = Storage::from_f32(x, Device::Cpu).unwrap();
    let g = Storage::from_f32(vec![0.25; rows * n], Device::Cpu).unwrap();
    for _ in 0..3 {
        let mut best = f64::MAX;
        let mut bestb = f64::MAX;
        for _ in 0..200 {
            let t = std::time::Instant::now();
            let o = s.softmax_rows(rows, n).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            let b = o.softmax_rows_backward(&g, rows, n).unwrap();
            bestb = bestb.min(t.elapsed().as_secs_f64());
            drop(b);
        }
        println!(
            "softmax {:.3} ms ({:.2} ns/elem)  backward {:.3} ms",
            best * 1e3,
            best * 1e9 / (rows * n) as f64,
            bestb * 1e3
        );
    }
}
