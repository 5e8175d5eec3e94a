import numpy as np

def sgd_step(param: np.ndarray, grad: np.ndarray, momentum_buffer: np.ndarray, lr: float,
             weight_decay: float, momentum: float, dampening: float, nesterov: bool) -> None: ...
def adam_step(param: np.ndarray, grad: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray,
              beta1: float, beta2: float, bias2_sqrt: float, eps: float, step_size: float,
              weight_decay: float, lr: float, decoupled: bool) -> None: ...
