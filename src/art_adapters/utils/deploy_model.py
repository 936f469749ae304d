"""`art_adapters.utils.deploy_model` (ART's older path, kept by ART for old scripts): the deployment names."""

from ..deployment import (
    DeploymentConfig,
    DeploymentResult,
    LoRADeploymentJob,
    LoRADeploymentProvider,
    Provider,
    TogetherDeploymentConfig,
    TogetherJobStatus,
    WandbDeploymentConfig,
    deploy_model,
    deploy_wandb,
)

__all__ = [
    "DeploymentConfig",
    "DeploymentResult",
    "LoRADeploymentJob",
    "LoRADeploymentProvider",
    "Provider",
    "TogetherDeploymentConfig",
    "TogetherJobStatus",
    "WandbDeploymentConfig",
    "deploy_model",
    "deploy_wandb",
]
