// grid.wgsl — put in front of every family's source. The kernels run 1-D
// grids of 64-wide workgroups; past 65,535 workgroups per dimension the host
// lays the grid out in 2-D (`grid1d`), and each invocation recovers its linear
// index here (then bounds-checks it: the last workgroup may run past the end).
fn grid_index(wg: vec3<u32>, groups: vec3<u32>, lane: u32) -> u32 {
    return (wg.y * groups.x + wg.x) * 64u + lane;
}
