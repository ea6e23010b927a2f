"""A script written against Twinkle's documented API (DeviceGroup/DeviceMesh and remote_class
pages), unchanged except that it runs on twinkle_ray: ``test_twinkle_script.py`` imports it
after aliasing ``twinkle`` to twinkle_ray. Each rank reports what it saw.
"""

import twinkle
from twinkle import DeviceGroup, DeviceMesh, Platform, remote_class, remote_function
from twinkle.infra import get_device_placement, is_master


def _dispatcher(length, i, args, kwargs, device_mesh):
    # Twinkle's custom dispatch: worker i gets item i of the first argument
    return (args[0][i],), kwargs


def _collect(all_results, device_mesh):
    return sorted(all_results)


@remote_class()
class MyComponent:

    def __init__(self, device_mesh: DeviceMesh = None, **kwargs):
        self.device_mesh = device_mesh

    @remote_function(dispatch='slice_dp', collect='flatten')
    def who(self, batch):
        mesh = self.device_mesh
        return [{
            'item': x,
            'rank': Platform.get_rank(),
            'world_size': Platform.get_world_size(),
            'local_rank': Platform.get_local_rank(),
            'is_master': is_master(),
            'dp_rank': mesh.dp_rank,
            'fsdp_rank': mesh.fsdp_rank,
            'pp_rank': mesh.pp_rank,
            'tp_rank': mesh.tp_rank,
            'data_rank': mesh.data_rank,
        } for x in batch]

    @remote_function(collect='last_pp_first', lazy_collect=False)
    def calculate_metric(self):
        return {'rank': Platform.get_rank(), 'pp_rank': self.device_mesh.pp_rank}

    @remote_function(collect='last_pp_first')
    def lazy_metric(self):
        return {'rank': Platform.get_rank(), 'pp_rank': self.device_mesh.pp_rank}

    @remote_function(dispatch=_dispatcher, collect=_collect)
    def pick(self, items):
        return items * 10 + Platform.get_rank()


@remote_class()
class Consumer:

    def __init__(self, **kwargs):
        pass

    @remote_function(dispatch='all', collect='none')
    def receive(self, value):
        return {'rank': Platform.get_rank(), 'value': value}


def main():
    device_groups = [
        DeviceGroup(name='actor', ranks=4, device_type='cuda'),
        DeviceGroup(name='reader', ranks=2, device_type='cuda'),
    ]
    twinkle.initialize('ray', groups=device_groups)
    actor_mesh = DeviceMesh.from_sizes(fsdp_size=2, dp_size=2, device_type='cpu')
    pp_mesh = DeviceMesh.from_sizes(pp_size=2, dp_size=2, device_type='cpu')

    actor = MyComponent(device_mesh=actor_mesh, remote_group='actor')
    seen = actor.who(list(range(8)))()
    pipeline = MyComponent(device_mesh=pp_mesh, remote_group='actor')
    metric = pipeline.calculate_metric()
    picked = pipeline.pick([1, 2, 3, 4])()
    reader = Consumer(remote_group='reader')
    routed = reader.receive(pipeline.lazy_metric())()
    placement = get_device_placement(device_groups)
    return {'seen': seen, 'metric': metric, 'picked': picked, 'routed': routed,
            'placement': placement}
