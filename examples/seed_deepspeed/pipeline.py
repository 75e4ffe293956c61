"""Seed 003's minimal DeepSpeed pipeline sample ("Pipeline"), with only the import changed.

    shardwise run --nproc-per-node 2 examples/seed_deepspeed/pipeline.py

The sample asks for the 'hccl' backend (Huawei Ascend) while its comment assumes NVIDIA GPUs; where the
named backend is not available, `init_distributed` says so and uses the device's own (gloo on CPU).
"""
import torch
import shardwise.deepspeed as deepspeed
from shardwise.deepspeed.pipe import PipelineModule, LayerSpec
import os

# 注意:华为昇腾(Ascend)芯片需使用'hccl'后端,NVIDIA GPU使用'nccl'
deepspeed.init_distributed(dist_backend='hccl')  # 假设使用NVIDIA GPU

# DeepSpeed配置需添加流水线并行参数
deepspeed_config = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 4,  # 
    "steps_per_print": 2,            # 新增关键参数
    "optimizer": {
        "type": "Adam",
        "params": {
            "lr": 0.001
        }
    },
    "pipeline": {
        "activation_checkpoint_interval": 1  # 启用激活检查点
    },
    "fp16": {  # 可选:添加混合精度支持
        "enabled": True
    }
}
# 修改数据集以包含标签
class SimpleDataset(torch.utils.data.Dataset):
    def __init__(self, data_size=1000, input_dim=784, output_dim=10):
        self.data = torch.randn(data_size, input_dim)
        self.labels = torch.randn(data_size, output_dim)
    
    def __len__(self):
        return len(self.data)
    
    def __getitem__(self, idx):
        return (self.data[idx], self.labels[idx])  # 返回输入和标签的元组

# 定义模型层
class SimpleLayer(torch.nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.fc = torch.nn.Linear(input_size, output_size)
    
    def forward(self, x):
        return torch.relu(self.fc(x))

# 构建流水线模型
layers = [
    LayerSpec(SimpleLayer, 784, 128),
    LayerSpec(SimpleLayer, 128, 10)
]

pipeline_model = PipelineModule(
    layers=layers,
    loss_fn=torch.nn.CrossEntropyLoss(),
    num_stages=2,          # 流水线阶段数需等于GPU数
    partition_method='uniform',  # 均匀划分层到各个阶段
)
dataset = SimpleDataset(data_size=10240)

# 初始化DeepSpeed引擎
model_engine, optimizer, _, _ = deepspeed.initialize(
    config=deepspeed_config,
    model=pipeline_model,
    model_parameters=pipeline_model.parameters(),
    training_data=dataset
)

# 准备数据加载器

for step in range(100): 
    loss = model_engine.train_batch()
