"""`art_adapters.utils.deployment` (ART's `art.utils.deployment`): deploy a checkpoint to Together or W&B, or (ours)
export it for any vLLM / OpenAI-compatible server; the behaviour lives in `art_adapters.deployment`."""

from ...deployment import (
    DeploymentConfig,
    DeploymentError,
    DeploymentResult,
    LoRADeploymentJob,
    LoRADeploymentProvider,
    Provider,
    TogetherDeploymentConfig,
    VLLMExportConfig,
    WandbDeploymentConfig,
    deploy_model,
    deploy_wandb,
    export_checkpoint,
)

__all__ = [
    "DeploymentConfig",
    "DeploymentError",
    "DeploymentResult",
    "LoRADeploymentJob",
    "LoRADeploymentProvider",
    "Provider",
    "TogetherDeploymentConfig",
    "VLLMExportConfig",
    "WandbDeploymentConfig",
    "deploy_model",
    "deploy_wandb",
    "export_checkpoint",
]
