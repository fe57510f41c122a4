//! CPU backend (being written).
use super::{Backend, DeviceInfo, MemoryInfo};
use crate::error::{BackendKind, Result};
use crate::problem::Problem;
use crate::weights::Weights;

#[derive(Clone, Debug, Default)]
pub struct CpuBackend;
impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}
pub struct CpuPrepared;
pub struct CpuWorkspace;
impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Prepared = CpuPrepared;
    type Workspace = CpuWorkspace;
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }
    fn info(&self) -> DeviceInfo {
        DeviceInfo::default()
    }
    fn prepare(&self, _w: &Weights) -> Result<CpuPrepared> {
        unimplemented!()
    }
    fn workspace(&self, _p: &CpuPrepared, _pr: &Problem) -> Result<CpuWorkspace> {
        unimplemented!()
    }
    fn workspace_fits(&self, _w: &CpuWorkspace, _p: &Problem) -> bool {
        false
    }
    fn workspace_bytes(&self, _p: &CpuPrepared, _pr: &Problem) -> u64 {
        0
    }
    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn buffer_len(b: &Vec<f32>) -> usize {
        b.len()
    }
    fn upload(&self, s: &[f32], d: &mut Vec<f32>) -> Result<()> {
        d.copy_from_slice(s);
        Ok(())
    }
    fn download(&self, s: &Vec<f32>, d: &mut [f32]) -> Result<()> {
        d.copy_from_slice(s);
        Ok(())
    }
    fn forward(
        &self,
        _p: &CpuPrepared,
        _w: &mut CpuWorkspace,
        _pr: &Problem,
        _x: &Vec<f32>,
        _m: Option<&Vec<f32>>,
        _y: &mut Vec<f32>,
    ) -> Result<()> {
        unimplemented!()
    }
    fn forward_host(
        &self,
        _p: &CpuPrepared,
        _w: &mut CpuWorkspace,
        _pr: &Problem,
        _x: &[f32],
        _m: Option<&[f32]>,
        _y: &mut [f32],
    ) -> Result<()> {
        unimplemented!()
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn measure_ceilings(&self) -> Result<super::Ceilings> {
        unimplemented!()
    }
    fn memory_info(&self) -> Result<Option<MemoryInfo>> {
        Ok(None)
    }
}
